/* Quantize float32 feature maps to bit-packed quantile codes in one pass per channel: the compression
 * half of the codec (pipeline/codec/native.py builds and loads this file together with
 * dequantize_moved.c; quantize() in pipeline/codec/quantile.py is the specification it is tested
 * against, byte for byte, and what runs where this cannot be built).
 *
 * Per sample and channel: the channel's min and max (k = 1) or the caller's clipping range (k > 1,
 * chosen by torch.topk), the float16 grid (lo16 rounded toward -inf, scale16 toward +inf, exactly as
 * quantile._float16_grid does it, float64 steps included), then every code as torch computes it:
 * t = fl(fl(x - lo16) * fl(1 / scale16)), clipped first for k > 1, code = trunc(fl(t + 0.5)). Then the
 * sample's codes are bit-packed (bitpack.py's format: code i at bit i * bits, least significant first).
 * -ffp-contract=off keeps the compiler from fusing the multiply and add into one rounding.
 *
 * Min and max are taken over the floats' total-order keys (an int32 per value, monotonic in the value
 * with -0 below +0 and NaNs beyond the infinities), so one integer pass finds the range, NaNs and
 * infinities alike. Where torch's answer is not determined by the values alone the kernel does not
 * guess: a channel whose minimum is zero and that holds both -0 and +0 (torch's amin returns either
 * sign, by its vector lanes) is reported, and the caller passes torch's own range instead. Values
 * outside float16's range, NaN, and scales that overflow float16 are reported too: the torch code
 * raises the error that names them. Samples are independent, so splitting them between threads
 * cannot change a byte.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "shares.h"

#define INLINE static inline __attribute__((always_inline))

/* Statuses (also the order of precedence when threads report different ones). */
enum { OK = 0, AMBIGUOUS_ZERO = 1, OUT_OF_RANGE = 2, SCALE_OVERFLOW = 3, NO_MEMORY = -1, BAD_ARGUMENTS = -2 };

/* float16 bits -> float32, exactly (as dequantize_moved.c's conversion; each file is self-contained). */
INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    float f;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2**-24, exact (a normal float32, no subnormal arithmetic) */
        f = (float)mantissa * 0x1p-24f;
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    const uint32_t bits = exponent == 0x1f ? sign | 0x7f800000u | (mantissa << 13) /* inf, nan */
                                           : sign | ((exponent + 112) << 23) | (mantissa << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* float32 -> float16 bits, round to nearest even, overflow to inf: torch's Tensor.half() on a CPU. */
INLINE uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00u; /* nan */
    if (x >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520: rounds to inf (inf itself too) */
    if (x >= 0x38800000u) { /* a normal float16: drop 13 mantissa bits, ties to even; a carry rounds up the exponent */
        x += 0xfffu + ((x >> 13) & 1u);
        return sign | (uint16_t)((x - 0x38000000u) >> 13);
    }
    if (x <= 0x33000000u) return sign; /* <= 2**-25: rounds to zero (2**-25 itself is a tie, to even) */
    /* a subnormal float16: the value in units of 2**-24, ties to even (2**-14 after rounding is the
     * smallest normal, whose bits are exactly the carry) */
    const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u, shift = 126u - e;
    uint32_t q = m >> shift;
    const uint32_t rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (q & 1u))) q++;
    return sign | (uint16_t)q;
}

/* torch.nextafter on float16 toward +inf and -inf (musl's definition; no nan gets here). */
INLINE uint16_t half_up(uint16_t h) {
    if (h == 0x7c00u) return h;
    if ((h & 0x7fffu) == 0) return 0x0001u;
    return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

INLINE uint16_t half_down(uint16_t h) {
    if (h == 0xfc00u) return h;
    if ((h & 0x7fffu) == 0) return 0x8001u;
    return (h & 0x8000u) ? (uint16_t)(h + 1u) : (uint16_t)(h - 1u);
}

INLINE double half_to_double(uint16_t h) { return (double)half_to_float(h); }

/* quantile._float16_grid for one channel, operation for operation. Returns OK or SCALE_OVERFLOW. */
INLINE int float16_grid(float lo, float hi, int levels, uint16_t *lo16_out, uint16_t *scale16_out) {
    const double lo64 = lo, hi64 = hi;
    const int constant = hi64 == lo64;
    uint16_t lo16 = float_to_half(lo);
    if (!constant && half_to_double(lo16) > lo64) lo16 = half_down(lo16);
    /* torch turns the float64 step into float16 through float32 (two roundings); the bump below
     * makes the result the float16 just above the step either way, but this is what torch does */
    const double step = constant ? 0.0 : (hi64 - half_to_double(lo16)) / (double)levels;
    uint16_t scale16 = float_to_half((float)step);
    if (half_to_double(scale16) < step) scale16 = half_up(scale16);
    if (!constant && half_to_double(lo16) + (double)levels * half_to_double(scale16) < hi64)
        scale16 = half_up(scale16);
    *lo16_out = lo16;
    *scale16_out = scale16;
    return (scale16 & 0x7fffu) == 0x7c00u ? SCALE_OVERFLOW : OK;
}

/* The total-order key of a float's bits: negative values have their magnitude bits flipped. */
static inline int32_t order_key(int32_t bits) { return bits ^ (int32_t)((uint32_t)(bits >> 31) >> 1); }

static float key_to_float(int32_t key) {
    const int32_t bits = order_key(key); /* the map is its own inverse */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int32_t key_of(float f) {
    int32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return order_key(bits);
}

/* The range of one channel; OK, OUT_OF_RANGE (nan, inf or beyond float16) or AMBIGUOUS_ZERO. */
INLINE int channel_range(const float *p, int64_t hw, float *lo, float *hi) {
    const int32_t *bits = (const int32_t *)(const void *)p;
    int32_t kmin = INT32_MAX, kmax = INT32_MIN;
    for (int64_t j = 0; j < hw; j++) {
        const int32_t k = order_key(bits[j]);
        kmin = k < kmin ? k : kmin;
        kmax = k > kmax ? k : kmax;
    }
    if (kmin < key_of(-65504.0f) || kmax > key_of(65504.0f)) return OUT_OF_RANGE;
    if (kmin == -1) { /* the minimum is -0: torch's sign is only certain if there is no +0 */
        for (int64_t j = 0; j < hw; j++)
            if (bits[j] == 0) return AMBIGUOUS_ZERO;
    }
    *lo = key_to_float(kmin);
    *hi = key_to_float(kmax);
    return OK;
}

/* Codes of one channel, exactly torch's float32 operations (see the file comment). */
INLINE void channel_codes(const float *restrict p, int64_t hw, float base, float inv, uint8_t *restrict codes) {
    for (int64_t j = 0; j < hw; j++) {
        float t = p[j] - base;
        t = t * inv;
        t = t + 0.5f;
        codes[j] = (uint8_t)(int32_t)t;
    }
}

INLINE void channel_codes_clipped(const float *restrict p, int64_t hw, float base, float inv, float low,
                                  float high, uint8_t *restrict codes) {
    for (int64_t j = 0; j < hw; j++) {
        float t = p[j] - base;
        t = t < low ? low : t;
        t = t > high ? high : t;
        t = t * inv;
        t = t + 0.5f;
        codes[j] = (uint8_t)(int32_t)t;
    }
}

/* Pack codes (< 2**bits; the buffer zero up to a multiple of 8) into out_bytes bytes, bitpack.py's
 * format: byte b holds codes b * per .. b * per + per - 1, the first in its low bits. */
INLINE void pack_row(const uint8_t *restrict c, int64_t out_bytes, int bits, uint8_t *restrict out) {
    if (bits == 4) {
        for (int64_t b = 0; b < out_bytes; b++) out[b] = (uint8_t)(c[2 * b] | c[2 * b + 1] << 4);
    } else if (bits == 2) {
        for (int64_t b = 0; b < out_bytes; b++)
            out[b] = (uint8_t)(c[4 * b] | c[4 * b + 1] << 2 | c[4 * b + 2] << 4 | c[4 * b + 3] << 6);
    } else {
        for (int64_t b = 0; b < out_bytes; b++)
            out[b] = (uint8_t)(c[8 * b] | c[8 * b + 1] << 1 | c[8 * b + 2] << 2 | c[8 * b + 3] << 3 |
                               c[8 * b + 4] << 4 | c[8 * b + 5] << 5 | c[8 * b + 6] << 6 | c[8 * b + 7] << 7);
    }
}

typedef struct {
    const float *x;
    int64_t first, last, channels, hw, row_bytes;
    int32_t bits, clip;
    float *lo, *hi; /* (n, channels): given (have_range) or written */
    int32_t have_range, isa;
    uint16_t *lo16, *scale16;
    uint8_t *packed;
    int status;
    int64_t where; /* sample * channels + channel of the first reported channel */
} Job;

/* One sample: every channel's range, grid and codes, then the packing. ``codes``: a buffer of the
 * sample's codes rounded up to 8, zero beyond them (unused for 8 bits). */
INLINE int quantize_sample(Job *j, int64_t i, uint8_t *codes) {
    const int64_t hw = j->hw, channels = j->channels;
    const int bits = j->bits, levels = (1 << bits) - 1;
    uint8_t *row = bits == 8 ? j->packed + i * j->row_bytes : codes;
    /* Channels in blocks: the ranges of a block, then its grids (independent of each other, so the
     * CPU overlaps their long chains of scalar steps), then its codes, while the block is in cache. */
    enum { BLOCK = 16 };
    for (int64_t first = 0; first < channels; first += BLOCK) {
        const int64_t end = first + BLOCK < channels ? first + BLOCK : channels;
        const int64_t at0 = i * channels;
        if (!j->have_range) {
            for (int64_t ch = first; ch < end; ch++) {
                const int status = channel_range(j->x + (at0 + ch) * hw, hw, &j->lo[at0 + ch], &j->hi[at0 + ch]);
                if (status != OK) {
                    j->where = at0 + ch;
                    return status;
                }
            }
        }
        int overflow = 0;
        for (int64_t ch = first; ch < end; ch++)
            overflow |= float16_grid(j->lo[at0 + ch], j->hi[at0 + ch], levels, &j->lo16[at0 + ch],
                                     &j->scale16[at0 + ch]);
        if (overflow) {
            for (int64_t ch = first; ch < end; ch++)
                if ((j->scale16[at0 + ch] & 0x7fffu) == 0x7c00u) {
                    j->where = at0 + ch;
                    break;
                }
            return SCALE_OVERFLOW;
        }
        for (int64_t ch = first; ch < end; ch++) {
            const int64_t at = at0 + ch;
            const float *p = j->x + at * hw;
            const float base = half_to_float(j->lo16[at]), s32 = half_to_float(j->scale16[at]);
            const float inv = s32 > 0.0f ? 1.0f / s32 : 0.0f; /* zero-range channels: every code is 0 */
            if (j->clip)
                channel_codes_clipped(p, hw, base, inv, j->lo[at] - base, j->hi[at] - base, row + ch * hw);
            else
                channel_codes(p, hw, base, inv, row + ch * hw);
        }
    }
    if (bits != 8) pack_row(codes, j->row_bytes, bits, j->packed + i * j->row_bytes);
    return OK;
}

/* The same code compiled for wider vectors, chosen at run time (the arithmetic is IEEE float32 on
 * every one of them, and no multiply-add is fused: the same bits). isa: 0 the build's baseline,
 * 1 AVX2, 2 AVX-512. */
typedef int (*SampleFn)(Job *, int64_t, uint8_t *);
static int sample_baseline(Job *j, int64_t i, uint8_t *codes) { return quantize_sample(j, i, codes); }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) static int sample_avx2(Job *j, int64_t i, uint8_t *codes) {
    return quantize_sample(j, i, codes);
}
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static int sample_avx512(Job *j, int64_t i,
                                                                                         uint8_t *codes) {
    return quantize_sample(j, i, codes);
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
    const int64_t length = j->channels * j->hw;
    const SampleFn fn = sample_fn(j->isa);
    uint8_t *codes = NULL;
    j->status = OK;
    if (j->bits != 8) {
        codes = calloc((size_t)((length + 7) / 8 * 8), 1); /* the tail stays zero: packing pads with it */
        if (!codes) {
            j->status = NO_MEMORY;
            return NULL;
        }
    }
    for (int64_t i = j->first; i < j->last && j->status == OK; i++) j->status = fn(j, i, codes);
    free(codes);
    return NULL;
}

/* x: float32 (n, channels, hw), contiguous. lo, hi: float32 (n, channels), read when have_range (then
 * clip says whether to clip to them, k > 1), else written with each channel's min and max. lo16,
 * scale16: float16 bits (n, channels), written. packed: (n, row_bytes), written. threads > 1 splits
 * the samples into that many shares (shares.h runs them). isa: the widest vectors to use (-1 or 2:
 * the best the CPU has; 1: AVX2 at most; 0: the baseline), for tests, which compare them all. Returns OK, a status above (then *where
 * names the first reported sample * channels + channel, and the outputs are incomplete), NO_MEMORY
 * or BAD_ARGUMENTS. */
int otl_quantize(const float *x, int64_t n, int64_t channels, int64_t hw, int32_t bits, float *lo, float *hi,
                 int32_t have_range, int32_t clip, uint16_t *lo16, uint16_t *scale16, uint8_t *packed,
                 int64_t row_bytes, int32_t threads, int32_t isa, int64_t *where) {
    if (n < 0 || channels < 0 || hw < 1 || threads < 1 || threads > 64 ||
        !(bits == 1 || bits == 2 || bits == 4 || bits == 8) || row_bytes != (channels * hw * bits + 7) / 8 ||
        (clip && !have_range))
        return BAD_ARGUMENTS;
    *where = -1;
    if (n == 0 || channels == 0) return OK;
    if (threads > n) threads = (int32_t)n;
    Job jobs[64];
    for (int t = 0; t < threads; t++) {
        jobs[t] = (Job){x, n * t / threads, n * (t + 1) / threads, channels, hw, row_bytes, bits, clip,
                        lo, hi, have_range, isa, lo16, scale16, packed, OK, -1};
    }
    run_shares(jobs, sizeof jobs[0], threads, run_job);
    /* a thread stops at its first report, so which one comes back may depend on the thread count; the
     * caller's answer to any of them (torch's range, torch's error) does not */
    int status = OK;
    for (int t = 0; t < threads; t++) {
        const int s = jobs[t].status;
        if (s == NO_MEMORY) return NO_MEMORY;
        if (s > status) status = s, *where = jobs[t].where;
    }
    return status;
}
