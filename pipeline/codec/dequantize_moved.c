/* Dequantize bit-packed quantile codes into float32 feature maps in one pass, moving every map by its
 * sample's crop (zero padding) and horizontal flip on the way: the inner loop of the dequantize and
 * feature_aug stages fused (pipeline/codec/native.py builds and loads this file; the torch ops in
 * pipeline/codec/quantile.py and pipeline/stages/feature_aug.py are the specification it is tested
 * against, bit for bit).
 *
 * Per sample: unpack its codes once (8-bit codes are read in place), reverse the rows of a flipped
 * sample's codes (a flip is then a shift, see dequantize_sample), then per channel write lo + code *
 * scale in one contiguous loop along the shift, +0.0 where the move reads outside the map. Float
 * arithmetic is exactly torch's: the product code * scale is exact (8-bit integer times a float16
 * value), the addition rounds once, and -ffp-contract=off keeps the compiler from fusing them
 * differently. Padding is written +0.0. The per-sample work is compiled for AVX2 and AVX-512 too and
 * picked at run time (the same bits: see sample_fn).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shares.h"

/* float16 bits -> float32, exactly (every float16 value is a float32 value). Done here rather than
 * by torch beforehand: a torch op would wake torch's OpenMP workers, which then spin on the cores
 * this kernel's threads need. */
static inline float half_to_float(uint16_t h) {
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
    int32_t isa;
    int status;
} Job;

#define INLINE static inline __attribute__((always_inline))

/* One row of packed codes -> one code per byte (``codes`` has room for a multiple of 8). Per 8 codes
 * one 64-bit word, spread out by bitpack.py's three rounds run backwards (shift, or, mask): plain
 * integer arithmetic on independent words, which the compiler vectorizes. */
INLINE void unpack_row(const uint8_t *restrict row, int64_t row_bytes, int bits, uint8_t *restrict codes) {
    int64_t done = 0; /* packed bytes handled by the word loop */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    const int64_t words = row_bytes / bits;
    if (bits == 4) {
        for (int64_t g = 0; g < words; g++) {
            uint32_t v;
            memcpy(&v, row + 4 * g, 4);
            uint64_t w = v;
            w = (w | w << 16) & 0x0000ffff0000ffffull;
            w = (w | w << 8) & 0x00ff00ff00ff00ffull;
            w = (w | w << 4) & 0x0f0f0f0f0f0f0f0full;
            memcpy(codes + 8 * g, &w, 8);
        }
    } else if (bits == 2) {
        for (int64_t g = 0; g < words; g++) {
            uint16_t v;
            memcpy(&v, row + 2 * g, 2);
            uint64_t w = v;
            w = (w | w << 24) & 0x000000ff000000ffull;
            w = (w | w << 12) & 0x000f000f000f000full;
            w = (w | w << 6) & 0x0303030303030303ull;
            memcpy(codes + 8 * g, &w, 8);
        }
    } else {
        for (int64_t g = 0; g < words; g++) {
            uint64_t w = row[g];
            w = (w | w << 28) & 0x0000000f0000000full;
            w = (w | w << 14) & 0x0003000300030003ull;
            w = (w | w << 7) & 0x0101010101010101ull;
            memcpy(codes + 8 * g, &w, 8);
        }
    }
    done = words * bits;
#endif
    const int per = 8 / bits, mask = (1 << bits) - 1;
    for (int64_t b = done; b < row_bytes; b++)
        for (int k = 0; k < per; k++) codes[b * per + k] = (uint8_t)((row[b] >> (k * bits)) & mask);
}

/* dst = src with each of its rows of ``w`` bytes reversed (a horizontal flip of every plane). */
static void reverse_rows_scalar(const uint8_t *restrict src, uint8_t *restrict dst, int64_t rows, int64_t w) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < w; c++) dst[r * w + c] = src[r * w + w - 1 - c];
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
/* The same with one byte shuffle per row of up to 16 bytes (per 16 bytes of a longer row). */
__attribute__((target("ssse3"))) static void reverse_rows_shuffle(const uint8_t *restrict src, uint8_t *restrict dst,
                                                                  int64_t rows, int64_t w) {
    const int64_t length = rows * w;
    if (w <= 16) {
        int8_t order[16];
        for (int c = 0; c < 16; c++) order[c] = (int8_t)(c < w ? w - 1 - c : 0x80); /* 0x80: a zero byte */
        const __m128i mask = _mm_loadu_si128((const __m128i *)(const void *)order);
        int64_t r = 0;
        /* 16 bytes read and written from each row's start, within the buffers: the bytes past the row
         * are the next row's, rewritten by its own store */
        for (; r * w + 16 <= length; r++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(src + r * w));
            _mm_storeu_si128((__m128i *)(void *)(dst + r * w), _mm_shuffle_epi8(v, mask));
        }
        reverse_rows_scalar(src + r * w, dst + r * w, rows - r, w);
        return;
    }
    const __m128i mask = _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *from = src + r * w;
        uint8_t *to = dst + r * w;
        /* output bytes [c, c + 16) are input bytes [w - 16 - c, w - c) reversed; the last block overlaps */
        for (int64_t c = 0;; c += 16) {
            if (c > w - 16) c = w - 16;
            const __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(from + w - 16 - c));
            _mm_storeu_si128((__m128i *)(void *)(to + c), _mm_shuffle_epi8(v, mask));
            if (c == w - 16) break;
        }
    }
}
#define HAVE_SHUFFLE 1
#else
#define HAVE_SHUFFLE 0
#endif

/* Per-thread scratch: a sample's codes one per byte, the same with rows reversed (a flip), and which
 * positions of a plane are inside the map after the move (all bits set) or padding (0). */
typedef struct {
    uint8_t *codes, *reversed;
    uint32_t *inside;
} Scratch;

/* One sample. A flip is turned into a shift: output (r, c) reads stored (r + dy, w - 1 - c + dx), which
 * is (r + dy, c - dx) of the planes with their rows reversed. So every map is a shift of some codes by
 * (dy, ex): per channel, one contiguous vectorized loop over the positions whose row has a source,
 * keeping lo + code * scale where the column has one too and +0.0 where not, and the rows with no
 * source set to +0.0 around it. 8-bit codes are read where they are unless flipped. */
INLINE void dequantize_sample(const Job *j, int64_t i, const Scratch *b, int shuffle) {
    const int64_t w = j->width, h = j->height, hw = h * w, channels = j->channels;
    const uint8_t *codes = j->packed + i * j->row_bytes;
    if (j->bits != 8) {
        unpack_row(codes, j->row_bytes, j->bits, b->codes);
        codes = b->codes;
    }
    const int64_t dy = j->dy ? j->dy[i] : 0, dx = j->dx ? j->dx[i] : 0;
    const int flip = j->flip ? j->flip[i] : 0;
    int64_t ex = dx;
    if (flip) {
#if HAVE_SHUFFLE
        if (shuffle)
            reverse_rows_shuffle(codes, b->reversed, channels * h, w);
        else
#endif
            reverse_rows_scalar(codes, b->reversed, channels * h, w);
        (void)shuffle;
        codes = b->reversed;
        ex = -dx;
    }
    /* rows [r0, r1) and columns [c0, c1) of the output have a source */
    int64_t r0 = dy < 0 ? -dy : 0, r1 = dy > 0 ? h - dy : h, c0 = ex < 0 ? -ex : 0, c1 = ex > 0 ? w - ex : w;
    if (r0 > h) r0 = h;
    if (r1 < r0) r1 = r0;
    if (c0 > w) c0 = w;
    if (c1 < c0) c1 = c0;
    if (c0 == c1) r1 = r0; /* no column has a source: all padding */
    const int64_t offset = dy * w + ex;
    /* positions in rows [r0, r1) whose read falls outside the plane are in columns without a source */
    int64_t p0 = r0 * w > -offset ? r0 * w : -offset, p1 = r1 * w < hw - offset ? r1 * w : hw - offset;
    if (p0 > hw) p0 = hw;
    if (p1 < p0) p1 = p0;
    const int columns_cut = c0 > 0 || c1 < w;
    if (columns_cut)
        for (int64_t r = 0; r < h; r++)
            for (int64_t c = 0; c < w; c++) b->inside[r * w + c] = c >= c0 && c < c1 ? 0xffffffffu : 0u;
    const uint32_t *inside = b->inside;
    for (int64_t ch = 0; ch < channels; ch++) {
        const uint8_t *plane = codes + ch * hw + offset;
        const float lo = half_to_float(j->lo[i * channels + ch]);
        const float scale = half_to_float(j->scale[i * channels + ch]);
        float *o = j->out + (i * channels + ch) * hw;
        if (columns_cut) {
            for (int64_t p = p0; p < p1; p++) { /* the bits of the value, or of +0.0: no branch */
                const float v = (float)plane[p] * scale + lo;
                uint32_t bits;
                memcpy(&bits, &v, sizeof bits);
                bits &= inside[p];
                memcpy(o + p, &bits, sizeof bits);
            }
        } else {
            for (int64_t p = p0; p < p1; p++) o[p] = (float)plane[p] * scale + lo;
        }
        memset(o, 0, sizeof(float) * (size_t)p0);
        memset(o + p1, 0, sizeof(float) * (size_t)(hw - p1));
    }
}

/* The same code compiled for wider vectors, chosen at run time: float32 arithmetic is IEEE on every
 * one, and -ffp-contract=off keeps the multiply and the add apart, so the bits are the same. */
typedef void (*SampleFn)(const Job *, int64_t, const Scratch *);
static void sample_baseline(const Job *j, int64_t i, const Scratch *b) { dequantize_sample(j, i, b, 0); }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) static void sample_avx2(const Job *j, int64_t i, const Scratch *b) {
    dequantize_sample(j, i, b, 1);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static void sample_avx512(const Job *j, int64_t i,
                                                                                          const Scratch *b) {
    dequantize_sample(j, i, b, 1);
}
static SampleFn sample_fn(int isa) {
    if (isa < 0) isa = 2;
    __builtin_cpu_init();
    if (isa >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return sample_avx512;
    if (isa >= 1 && __builtin_cpu_supports("avx2")) return sample_avx2;
    return sample_baseline;
}
#else
static SampleFn sample_fn(int isa) {
    (void)isa;
    return sample_baseline;
}
#endif

static void *run_job(void *arg) {
    Job *j = (Job *)arg;
    const int64_t hw = j->height * j->width, length = j->channels * hw, room = (length + 7) / 8 * 8;
    const SampleFn fn = sample_fn(j->isa);
    Scratch b = {malloc((size_t)room), malloc((size_t)room), malloc(sizeof(uint32_t) * (size_t)hw)};
    if (!b.codes || !b.reversed || !b.inside) {
        free(b.codes), free(b.reversed), free(b.inside);
        j->status = -1;
        return NULL;
    }
    for (int64_t i = j->first; i < j->last; i++) fn(j, i, &b);
    free(b.codes), free(b.reversed), free(b.inside);
    j->status = 0;
    return NULL;
}

/* lo, scale: float16 bit patterns, (n, channels). Returns 0, or -1 when memory ran out, -2 for arguments out of
 * range. dy/dx/flip all NULL: no move. threads > 1 splits the samples into that many shares (shares.h runs
 * them). isa: the widest vectors to use (-1 or 2: the best the CPU has; 1: AVX2 at most; 0: the baseline), for
 * tests, which compare them all. */
int otl_dequantize_moved(const uint8_t *packed, int64_t n, int64_t row_bytes, int32_t bits, int64_t channels,
                         int64_t height, int64_t width, const uint16_t *lo, const uint16_t *scale, const int32_t *dy,
                         const int32_t *dx, const uint8_t *flip, float *out, int32_t threads, int32_t isa) {
    if (n < 0 || channels < 0 || height < 0 || width < 0 || threads < 1 || threads > 64 ||
        !(bits == 1 || bits == 2 || bits == 4 || bits == 8) ||
        row_bytes != (channels * height * width * bits + 7) / 8 || height * width > INT32_MAX)
        return -2;
    if (n == 0 || channels * height * width == 0) return 0;
    if (threads > n) threads = (int32_t)n;
    Job jobs[64];
    for (int t = 0; t < threads; t++) {
        jobs[t] = (Job){packed, row_bytes, n * t / threads, n * (t + 1) / threads, bits, channels, height,
                        width, lo, scale, dy, dx, flip, out, isa, -1};
    }
    run_shares(jobs, sizeof jobs[0], threads, run_job);
    int status = 0;
    for (int t = 0; t < threads; t++)
        if (jobs[t].status != 0) status = jobs[t].status;
    return status;
}
