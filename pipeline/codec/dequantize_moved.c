/* Dequantize bit-packed quantile codes into float32 feature maps in one pass, moving every map by its
 * sample's crop (zero padding) and horizontal flip on the way: the inner loop of the dequantize and
 * feature_aug stages fused (pipeline/codec/native.py builds and loads this file; the torch ops in
 * pipeline/codec/quantile.py and pipeline/stages/feature_aug.py are the specification it is tested
 * against, bit for bit).
 *
 * Per sample: unpack its codes once through a 256-entry byte table and list the output positions
 * that are padding, then per channel write lo + code * scale: an unflipped map (a shift) in one
 * contiguous loop, a flipped one row by row, each read backwards; then zero the padding. Float
 * arithmetic is exactly torch's: the product code * scale is exact (8-bit integer times a float16
 * value), the addition rounds once, and -ffp-contract=off keeps the compiler from fusing them
 * differently. Padding is written +0.0.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* float16 bits -> float32, exactly (every float16 value is a float32 value). Done here rather than
 * by torch beforehand: a torch op would wake torch's OpenMP workers, which then spin on the cores
 * this kernel's threads need. */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: mantissa * 2**-24, normalized */
        uint32_t e = 113;
        while (!(mantissa & 0x400u)) mantissa <<= 1, e--;
        bits = sign | (e << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

typedef struct {
    const uint8_t *packed;
    int64_t row_bytes, first, last;
    int32_t bits;
    int64_t channels, height, width;
    const uint16_t *lo, *scale;
    const int32_t *dy, *dx;
    const uint8_t *flip;
    float *out;
    int status;
} Job;

static void *run_job(void *arg) {
    Job *j = (Job *)arg;
    const int64_t hw = j->height * j->width, w = j->width, h = j->height;
    const int bits = j->bits, per = 8 / bits, mask = (1 << bits) - 1;
    uint8_t *codes = malloc((size_t)(j->row_bytes * per));
    int32_t *padding = malloc(sizeof(int32_t) * (size_t)hw);
    uint8_t table[256][8];
    if (!codes || !padding) {
        free(codes), free(padding);
        j->status = -1;
        return NULL;
    }
    for (int v = 0; v < 256; v++)
        for (int k = 0; k < per; k++) table[v][k] = (uint8_t)((v >> (k * bits)) & mask);
    for (int64_t i = j->first; i < j->last; i++) {
        const uint8_t *row = j->packed + i * j->row_bytes;
        if (bits == 8) {
            memcpy(codes, row, (size_t)j->row_bytes);
        } else {
            for (int64_t b = 0; b < j->row_bytes; b++) memcpy(codes + b * per, table[row[b]], (size_t)per);
        }
        int64_t pads = 0;
        const int64_t dy = j->dy ? j->dy[i] : 0, dx = j->dx ? j->dx[i] : 0;
        const int flip = j->flip ? j->flip[i] : 0;
        const int64_t offset = dy * w + dx;
        for (int64_t r = 0; r < h; r++) {
            for (int64_t c = 0; c < w; c++) {
                const int64_t sr = r + dy, sc = (flip ? w - 1 - c : c) + dx;
                if (sr < 0 || sr >= h || sc < 0 || sc >= w) padding[pads++] = (int32_t)(r * w + c);
            }
        }
        for (int64_t ch = 0; ch < j->channels; ch++) {
            const uint8_t *plane = codes + ch * hw;
            const float lo = half_to_float(j->lo[i * j->channels + ch]);
            const float scale = half_to_float(j->scale[i * j->channels + ch]);
            float *o = j->out + (i * j->channels + ch) * hw;
            if (!flip) {
                /* A shift reads the plane at a constant offset: one contiguous, vectorized loop. Positions
                 * whose read falls off the plane are padding; those inside it that wrap across a row
                 * edge are padding too; both are zeroed below. */
                const int64_t first = offset < 0 ? -offset : 0, end = offset > 0 ? hw - offset : hw;
                for (int64_t p = first; p < end; p++) o[p] = (float)plane[p + offset] * scale + lo;
            } else {
                /* A flip reads each row backwards: output (r, c) reads (r + dy, w - 1 - c + dx). */
                const int64_t first = dx > 0 ? dx : 0, end = dx < 0 ? w + dx : w;
                for (int64_t r = 0; r < h; r++) {
                    const int64_t sr = r + dy;
                    if (sr < 0 || sr >= h) continue; /* a padding row */
                    const uint8_t *from = plane + sr * w + (w - 1 + dx);
                    float *to = o + r * w;
                    for (int64_t c = first; c < end; c++) to[c] = (float)from[-c] * scale + lo;
                }
            }
            for (int64_t k = 0; k < pads; k++) o[padding[k]] = 0.0f;
        }
    }
    free(codes), free(padding);
    j->status = 0;
    return NULL;
}

/* lo, scale: float16 bit patterns, (n, channels). Returns 0, or -1 when memory ran out, -2 for arguments out of range. dy/dx/flip all NULL: no move.
 * threads > 1 splits the samples between this thread and threads - 1 new ones. */
int otl_dequantize_moved(const uint8_t *packed, int64_t n, int64_t row_bytes, int32_t bits, int64_t channels,
                         int64_t height, int64_t width, const uint16_t *lo, const uint16_t *scale, const int32_t *dy,
                         const int32_t *dx, const uint8_t *flip, float *out, int32_t threads) {
    if (n < 0 || channels < 0 || height < 0 || width < 0 || threads < 1 || threads > 64 ||
        !(bits == 1 || bits == 2 || bits == 4 || bits == 8) ||
        row_bytes != (channels * height * width * bits + 7) / 8 || height * width > INT32_MAX)
        return -2;
    if (n == 0 || channels * height * width == 0) return 0;
    if (threads > n) threads = (int32_t)n;
    Job jobs[64];
    pthread_t ids[64];
    int started[64] = {0};
    for (int t = 0; t < threads; t++) {
        jobs[t] = (Job){packed, row_bytes, n * t / threads, n * (t + 1) / threads, bits, channels, height,
                        width, lo, scale, dy, dx, flip, out, -1};
    }
    for (int t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    int status = jobs[0].status;
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else run_job(&jobs[t]);  /* no thread to be had: do its share here */
        if (jobs[t].status != 0) status = jobs[t].status;
    }
    return status;
}
