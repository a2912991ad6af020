/* NVFP4 -> fp32 / bf16 / fp16 dequantizer for CPUs, bit-exact with optimum_pact.nvfp4.format.dequantize_reference.
 *
 * Plain C11 (no torch headers), built by kernels.py with `cc -O3 -march=native -fopenmp -shared -fPIC
 * -ffp-contract=off` (no -ffast-math: denormals must be kept) and called through ctypes (which releases the GIL)
 * with raw pointers and row strides; the last dimension of every array is contiguous.
 *
 * Layout: qdata uint8 [n, k/2] (element 2i in the LOW nibble of byte i), scale e4m3 [n, k/16], scale_2 fp32.
 * Value: fp32(fp32(E2M1[code] * fp32(scale)) * scale_2), then rounded to nearest even into the output dtype.
 *
 * Design: a block's 16 outputs depend only on its scale BYTE (scale_2 is per tensor). So each call first builds
 * the table of all 256 x 16 possible outputs, already in the output dtype (8 KiB bf16/fp16, 16 KiB fp32: stays in
 * L1), with the reference's own operations. Dequantizing is then pure look-up: with AVX-512, two blocks' 16-entry
 * rows form one 32-word table and a single vpermw turns 16 packed bytes into 32 bf16/fp16 values (vpermps and 16
 * values per block for fp32). Without AVX-512, AVX2 does the same with vpermps / pshufb on half-rows. The portable
 * path does the same look-ups one element at a time. The fused product for few rows (decoding, pact_nvfp4_linear)
 * multiplies x by the same table's values; its AVX2 path instead factors each block's scale out (dot_avx2).
 *
 * Threads: an OpenMP team whose threads claim chunks of rows; see run() for how it copes with a busy machine.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h> /* pread */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PACT_AVX512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define PACT_AVX2 1
#endif

enum { OUT_F32 = 0, OUT_BF16 = 1, OUT_F16 = 2 };

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* e4m3fn byte -> fp32: sign 1, exponent 4 (bias 7), mantissa 3; exponent 0 is subnormal (m * 2^-9).
 * 0x7F / 0xFF are NaN in e4m3fn; valid NVFP4 data never holds them (their table rows are never read). */
static float e4m3_to_f32(uint8_t b) {
    uint32_t sign = (uint32_t)(b >> 7) << 31, e = (b >> 3) & 0xF, m = b & 7;
    if (e == 0) return bits_f32(f32_bits((float)m * 0x1p-9f) | sign);
    return bits_f32(sign | ((e + 120) << 23) | (m << 20));
}

/* fp32 -> bf16, round to nearest even, keeping denormals (as torch does); inputs are never NaN here. */
static uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* fp32 -> IEEE fp16, round to nearest even, with fp16 subnormals and overflow to inf. */
static uint16_t f32_to_f16(float f) {
    uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000u, e;
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (x > 0x7F800000u ? 0x200u : 0u));
    if (x >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to inf */
    if (x >= 0x38800000u) {                                    /* fp16 normal: drop 13 mantissa bits, RNE */
        x += 0xFFFu + ((x >> 13) & 1u);
        return (uint16_t)(sign | ((x - 0x38000000u) >> 13));
    }
    e = x >> 23; /* fp16 subnormal: round (mantissa with implicit bit) >> shift, in units of 2^-24 */
    if (e < 102) return (uint16_t)sign;
    {
        uint32_t m = (x & 0x7FFFFFu) | 0x800000u, shift = 126 - e, q = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
        q += (rem > half) || (rem == half && (q & 1u));
        return (uint16_t)(sign | q);
    }
}

/* 16-bit input -> fp32 (exact): bf16 is the top half of an fp32; fp16 normals, subnormals and inf/NaN rebased. */
static float bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    if (e == 0) return bits_f32(f32_bits((float)m * 0x1p-24f) | sign);
    if (e == 31) return bits_f32(sign | 0x7F800000u | (m << 13));
    return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

/* One row, portable code: out[j] = table[scale byte][code]. */
static inline __attribute__((always_inline)) void row_scalar(const uint8_t *q, const uint8_t *s, const void *table,
                                                             int64_t nblocks, void *out, int dtype) {
    for (int64_t b = 0; b < nblocks; b++) {
        if (dtype == OUT_F32) {
            const float *t = (const float *)table + 16 * s[b];
            float *o = (float *)out + b * 16;
            for (int i = 0; i < 8; i++) o[2 * i] = t[q[b * 8 + i] & 0xF], o[2 * i + 1] = t[q[b * 8 + i] >> 4];
        } else {
            const uint16_t *t = (const uint16_t *)table + 16 * s[b];
            uint16_t *o = (uint16_t *)out + b * 16;
            for (int i = 0; i < 8; i++) o[2 * i] = t[q[b * 8 + i] & 0xF], o[2 * i + 1] = t[q[b * 8 + i] >> 4];
        }
    }
}

#ifdef PACT_AVX512
/* One row with AVX-512 (F + BW). */
static inline __attribute__((always_inline)) void row_avx512(const uint8_t *q, const uint8_t *s, const void *table,
                                                             int64_t nblocks, void *out, int dtype) {
    int64_t b = 0;
    if (dtype == OUT_F32) {
        /* 8 bytes -> 16 dword indices (each byte twice, odd lanes shifted right by 4): vpermps reads only the low
         * 4 bits of an index, so even lanes take the low nibble and odd lanes the high one */
        const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        for (; b < nblocks; b++) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + b * 8));
            __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes)), shifts);
            __m512 row = _mm512_loadu_ps((const float *)table + 16 * s[b]);
            _mm512_storeu_ps((float *)out + b * 16, _mm512_permutexvar_ps(idx, row));
        }
        return;
    }
    /* bf16 / fp16, two blocks at a time: 16 bytes -> 32 word indices into [row of block b, row of block b+1].
     * Dword i = byte i; (d | d << 12) & 0x000F000F puts its low nibble in word 2i and its high nibble in word 2i+1;
     * the second block's words get +16. */
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F);
    const __m512i second = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x100010, 0x100010, 0x100010, 0x100010,
                                             0x100010, 0x100010, 0x100010, 0x100010);
    const uint16_t *t = (const uint16_t *)table;
    for (; b + 1 < nblocks; b += 2) {
        __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 8)));
        __m512i idx = _mm512_or_si512(_mm512_and_si512(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), nibbles), second);
        __m512i rows = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(t + 16 * s[b]))),
                                          _mm256_loadu_si256((const __m256i *)(t + 16 * s[b + 1])), 1);
        _mm512_storeu_si512((uint16_t *)out + b * 16, _mm512_permutexvar_epi16(idx, rows));
    }
    if (b < nblocks) row_scalar(q + b * 8, s + b, table, nblocks - b, (uint16_t *)out + b * 16, dtype);
}
#endif

#ifdef PACT_AVX2
/* Look up 8 values of a block's fp32 table row from their codes. Codes 8-15 are codes 0-7 negated (E2M1's sign bit;
 * the table's products negate exactly), so one vpermps on the row's first 8 entries (it reads an index's low 3 bits)
 * and bit 3 moved to the sign bit give all 16. Bits above 3 of an index are ignored. */
static inline __attribute__((always_inline)) __m256 lookup16(__m256 magnitudes, __m256i idx) {
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(idx, 28), _mm256_set1_epi32((int)0x80000000u));
    return _mm256_xor_ps(_mm256_permutevar8x32_ps(magnitudes, idx), _mm256_castsi256_ps(sign));
}

/* A block's 8 packed bytes -> its 16 codes as two sets of 8 dword indices, in element order (the low 4 bits of each
 * dword; what lies above is ignored by lookup16). */
static inline __attribute__((always_inline)) void codes16(const uint8_t *q, __m256i *first, __m256i *second) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)q), twice = _mm_unpacklo_epi8(bytes, bytes);
    *first = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(twice), shifts);
    *second = _mm256_srlv_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(twice, 8)), shifts);
}

/* One row with AVX2. fp32: two 8-value look-ups per block. bf16 / fp16: `split` holds each table row's low bytes
 * then its high bytes (32 bytes a scale), so pshufb looks up 16 codes' low and high bytes at once. */
static inline __attribute__((always_inline)) void row_avx2(const uint8_t *q, const uint8_t *s, const void *table,
                                                           const uint8_t *split, int64_t nblocks, void *out,
                                                           int dtype) {
    if (dtype == OUT_F32) {
        for (int64_t b = 0; b < nblocks; b++) {
            const __m256 magnitudes = _mm256_loadu_ps((const float *)table + 16 * s[b]);
            __m256i first, second;
            codes16(q + b * 8, &first, &second);
            _mm256_storeu_ps((float *)out + b * 16, lookup16(magnitudes, first));
            _mm256_storeu_ps((float *)out + b * 16 + 8, lookup16(magnitudes, second));
        }
        return;
    }
    const __m128i nibble = _mm_set1_epi8(0xF);
    for (int64_t b = 0; b < nblocks; b++) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + b * 8));
        const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, nibble),
                                                _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble));
        const __m128i lo = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(split + 32 * s[b])), codes);
        const __m128i hi = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(split + 32 * s[b] + 16)), codes);
        _mm_storeu_si128((__m128i *)((uint16_t *)out + b * 16), _mm_unpacklo_epi8(lo, hi));
        _mm_storeu_si128((__m128i *)((uint16_t *)out + b * 16 + 8), _mm_unpackhi_epi8(lo, hi));
    }
}
#endif

/* A call's work: rows [0, n) in chunks of ~16K elements, claimed by the threads through `next`. */
typedef struct {
    const uint8_t *qdata, *scale;
    const void *table;
    const uint8_t *split; /* AVX2, 16-bit outputs: the table's low and high bytes, 32 bytes a scale */
    void *out;
    int64_t q_stride, s_stride, n, k, chunk, nchunks;
    int dtype, scalar;
    const float *x; /* fused product (pact_nvfp4_linear): m input rows [m, k], output y [m, n]; x == NULL: dequantize */
    void *y;        /* in `dtype` */
    int64_t m;
    const float *sc, *xp;     /* AVX2 fused product: block scales fp32(e4m3 * scale_2) / 2, x reordered (dot_avx2) */
    const float *xa, *lora_b; /* optional LoRA term: xa = scaling * x @ A.T [m, rank], lora_b = B [n, rank] */
    int64_t rank;
    const void *dense; /* a dense weight [n, k] (row stride d_stride) instead of the packed one, of kind dense_kind */
    int64_t d_stride;
    int dense_kind; /* DENSE_BF16, DENSE_F16 or DENSE_F32 */
    atomic_llong next; /* the next chunk to claim */
} job_t;

/* sum_t a[t] * b[t] in 16 fp32 lanes summed at the end (the compiler vectorizes the lanes; no reassociation). */
static float dot(const float *a, const float *b, int64_t len) {
    float acc[16] = {0}, sum = 0.0f;
    int64_t t = 0;
    for (; t + 16 <= len; t += 16)
        for (int c = 0; c < 16; c++) acc[c] += a[t + c] * b[t + c];
    for (; t < len; t++) acc[t % 16] += a[t] * b[t];
    for (int c = 0; c < 16; c++) sum += acc[c];
    return sum;
}

static void store(void *y, int64_t at, float v, int dtype) {
    if (dtype == OUT_F32) ((float *)y)[at] = v;
    else ((uint16_t *)y)[at] = dtype == OUT_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
}

#ifdef PACT_AVX2
#ifdef __FMA__
#define FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define FMADD(a, b, c) _mm256_add_ps(_mm256_mul_ps(a, b), c)
#endif
/* Twice the E2M1 values as int8, by code: 2 * {0, 0.5, 1, 1.5, 2, 3, 4, 6}, then the same negated. */
static const int8_t E2M1_X2[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* The same values as bf16 (-0 as +0, like E2M1_X2): their high bytes and their low bytes, for pshufb. */
static const uint8_t X2_BF16_HI[16] = {0x00, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41,
                                       0x00, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0, 0xC1, 0xC1};
static const uint8_t X2_BF16_LO[16] = {0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40,
                                       0x00, 0x80, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x40};

/* Blocks' sum_c xp[16 b + c] * 2 E2M1[code] * sc[s[b]], for blocks whose 16 x values are reordered evens then odds
 * (the order of the low then high nibbles of its 8 bytes): pshufb turns 16 packed bytes (two blocks) into their 32
 * small integers, which are converted to fp32. Used for the last nblocks % 4 blocks of a row (see dot_avx2).
 * noinline: inlined, gcc spilled the loop's constants to the stack. */
static __attribute__((noinline)) __m256 blocks_avx2(const uint8_t *q, const uint8_t *s, const float *sc,
                                                    const float *xp, int64_t nblocks) {
    const __m128i lut = _mm_loadu_si128((const __m128i *)E2M1_X2), low = _mm_set1_epi8(0x0F);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nblocks; b += 2) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(q + b * 8));
        const __m128i ev = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low));
        const __m128i od = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        const float *x = xp + b * 16;
        __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ev)), _mm256_loadu_ps(x));
        __m256 p1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(ev, 8))), _mm256_loadu_ps(x + 16));
        p0 = FMADD(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(od)), _mm256_loadu_ps(x + 8), p0);
        p1 = FMADD(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(od, 8))), _mm256_loadu_ps(x + 24), p1);
        acc0 = FMADD(p0, _mm256_set1_ps(sc[s[b]]), acc0);
        acc1 = FMADD(p1, _mm256_set1_ps(sc[s[b + 1]]), acc1);
    }
    if (b < nblocks) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + b * 8));
        const __m128i ev = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low));
        const __m128i od = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        const float *x = xp + b * 16;
        __m256 p0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ev)), _mm256_loadu_ps(x));
        p0 = FMADD(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(od)), _mm256_loadu_ps(x + 8), p0);
        acc0 = FMADD(p0, _mm256_set1_ps(sc[s[b]]), acc0);
    }
    return _mm256_add_ps(acc0, acc1);
}

/* Where dot_avx2 wants element p (0-63) of a group of 4 blocks (64 x values): it computes in 8 vectors of 8, the
 * first 4 holding blocks 0 and 2 (one per 128-bit half), the last 4 blocks 1 and 3; in each, the even elements then
 * the odd ones (low then high nibbles), byte 0-3 then 4-7 of the block. */
static int64_t group_slot(int64_t p) {
    const int64_t block = p / 16, odd = p % 2, byte = p % 16 / 2;
    return block % 2 * 32 + odd * 16 + byte / 4 * 8 + block / 2 * 4 + byte % 4;
}

/* One weight row against one x row with AVX2, each block's scale factored out of its sum:
 * sum_b sc[s[b]] * sum_c x[16 b + c] * 2 E2M1[code] (+ the LoRA term sum_t xa[t] * lb[t]), where sc holds
 * fp32(e4m3 * scale_2) / 2 and xp is x reordered (group_slot, then blocks_avx2's order for the last nblocks % 4
 * blocks). Four blocks (32 packed bytes) a step: two pshufb give each code's 2 E2M1 as the high and low byte of a
 * bf16, and unpacking them with zeros makes fp32 directly (no integer conversion): about a fifth fewer instructions
 * than converting from int8 (0.094 vs 0.118 ns/weight, one thread, 210 SmolLM2 layers with a rank-8 adapter,
 * streamed from memory). Equal to the reference up to fp32 rounding order (each product and sum rounds once). */
static __attribute__((noinline)) float dot_avx2(const uint8_t *q, const uint8_t *s, const float *sc, const float *xp,
                                                int64_t nblocks, const float *xa, const float *lb, int64_t rank) {
    const __m256i hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)X2_BF16_HI));
    const __m256i lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)X2_BF16_LO));
    const __m256i low = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 3 < nblocks; b += 4) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + b * 8));
        const __m256i ev = _mm256_and_si256(bytes, low), od = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
        const __m256i evh = _mm256_shuffle_epi8(hi, ev), evl = _mm256_shuffle_epi8(lo, ev);
        const __m256i odh = _mm256_shuffle_epi8(hi, od), odl = _mm256_shuffle_epi8(lo, od);
        /* bf16 words: blocks 0 | 2 (a) and 1 | 3 (b), even and odd elements */
        const __m256i ea = _mm256_unpacklo_epi8(evl, evh), eb = _mm256_unpackhi_epi8(evl, evh);
        const __m256i oa = _mm256_unpacklo_epi8(odl, odh), ob = _mm256_unpackhi_epi8(odl, odh);
        const float *x = xp + b * 16;
#define F32(words, half) _mm256_castsi256_ps(_mm256_unpack##half##_epi16(zero, words))
        __m256 pa = _mm256_mul_ps(F32(ea, lo), _mm256_loadu_ps(x));
        pa = FMADD(F32(ea, hi), _mm256_loadu_ps(x + 8), pa);
        pa = FMADD(F32(oa, lo), _mm256_loadu_ps(x + 16), pa);
        pa = FMADD(F32(oa, hi), _mm256_loadu_ps(x + 24), pa);
        __m256 pb = _mm256_mul_ps(F32(eb, lo), _mm256_loadu_ps(x + 32));
        pb = FMADD(F32(eb, hi), _mm256_loadu_ps(x + 40), pb);
        pb = FMADD(F32(ob, lo), _mm256_loadu_ps(x + 48), pb);
        pb = FMADD(F32(ob, hi), _mm256_loadu_ps(x + 56), pb);
#undef F32
        const __m256 sa = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc + s[b])),
                                               _mm_broadcast_ss(sc + s[b + 2]), 1);
        const __m256 sb = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(sc + s[b + 1])),
                                               _mm_broadcast_ss(sc + s[b + 3]), 1);
        acc0 = FMADD(pa, sa, acc0);
        acc1 = FMADD(pb, sb, acc1);
    }
    if (b < nblocks) acc0 = _mm256_add_ps(acc0, blocks_avx2(q + b * 8, s + b, sc, xp + b * 16, nblocks - b));
    int64_t t = 0;
    for (; t + 8 <= rank; t += 8) acc1 = FMADD(_mm256_loadu_ps(xa + t), _mm256_loadu_ps(lb + t), acc1);
    const __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    float sum = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
    for (; t < rank; t++) sum += xa[t] * lb[t];
    return sum;
}
#endif

/* sum_t w[t] * x[t] for a dense weight row: 16-bit (bf16, or fp16) widened to fp32 (exact), or fp32 (an output head):
 * SIMD in four accumulators of lanes (loads in flight while adds wait), summed at the end; the portable code in 16
 * lanes (k is a multiple of 16). */
enum { DENSE_BF16 = 0, DENSE_F16 = 1, DENSE_F32 = 2 };
#if defined(PACT_AVX512)
#define BF16X16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define F16X16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define DENSE_DOT(name, T, WIDEN)                                                                                        \
    static float name(const T *w, const float *x, int64_t k) {                                                \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                                   \
        int64_t t = 0;                                                                                                \
        for (; t + 64 <= k; t += 64) {                                                                                \
            a0 = _mm512_add_ps(a0, _mm512_mul_ps(WIDEN(w + t), _mm512_loadu_ps(x + t)));                              \
            a1 = _mm512_add_ps(a1, _mm512_mul_ps(WIDEN(w + t + 16), _mm512_loadu_ps(x + t + 16)));                    \
            a2 = _mm512_add_ps(a2, _mm512_mul_ps(WIDEN(w + t + 32), _mm512_loadu_ps(x + t + 32)));                    \
            a3 = _mm512_add_ps(a3, _mm512_mul_ps(WIDEN(w + t + 48), _mm512_loadu_ps(x + t + 48)));                    \
        }                                                                                                             \
        for (; t < k; t += 16) a0 = _mm512_add_ps(a0, _mm512_mul_ps(WIDEN(w + t), _mm512_loadu_ps(x + t)));          \
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));                    \
    }
#define F32X16(p) _mm512_loadu_ps(p)
DENSE_DOT(dense_dot_bf16, uint16_t, BF16X16)
DENSE_DOT(dense_dot_f16, uint16_t, F16X16)
DENSE_DOT(dense_dot_f32, float, F32X16)
#define PACT_DENSE_SIMD 1
#elif defined(PACT_AVX2) && defined(__F16C__)
#define BF16X8(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define F16X8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define DENSE_DOT(name, T, WIDEN)                                                                                        \
    static float name(const T *w, const float *x, int64_t k) {                                                \
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                                   \
        int64_t t = 0;                                                                                                \
        for (; t + 32 <= k; t += 32) {                                                                                \
            a0 = _mm256_add_ps(a0, _mm256_mul_ps(WIDEN(w + t), _mm256_loadu_ps(x + t)));                              \
            a1 = _mm256_add_ps(a1, _mm256_mul_ps(WIDEN(w + t + 8), _mm256_loadu_ps(x + t + 8)));                      \
            a2 = _mm256_add_ps(a2, _mm256_mul_ps(WIDEN(w + t + 16), _mm256_loadu_ps(x + t + 16)));                    \
            a3 = _mm256_add_ps(a3, _mm256_mul_ps(WIDEN(w + t + 24), _mm256_loadu_ps(x + t + 24)));                    \
        }                                                                                                             \
        for (; t < k; t += 8) a0 = _mm256_add_ps(a0, _mm256_mul_ps(WIDEN(w + t), _mm256_loadu_ps(x + t)));           \
        const __m256 acc = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));                              \
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));                            \
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));                                                                       \
        return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));                                                      \
    }
#define F32X8(p) _mm256_loadu_ps(p)
DENSE_DOT(dense_dot_bf16, uint16_t, BF16X8)
DENSE_DOT(dense_dot_f16, uint16_t, F16X8)
DENSE_DOT(dense_dot_f32, float, F32X8)
#define PACT_DENSE_SIMD 1
#endif

static float dense_dot(const void *w, const float *x, int64_t k, int kind, int scalar) {
#ifdef PACT_DENSE_SIMD
    if (!scalar && kind == DENSE_F32) return dense_dot_f32((const float *)w, x, k);
    if (!scalar) return kind == DENSE_F16 ? dense_dot_f16(w, x, k) : dense_dot_bf16(w, x, k);
#endif
    if (kind == DENSE_F32) return dot((const float *)w, x, k); /* 16 lanes, as below */
    const uint16_t *h = (const uint16_t *)w;
    float acc[16] = {0}, sum = 0.0f;
    for (int64_t t = 0; t < k; t += 16)
        for (int c = 0; c < 16; c++)
            acc[c] += (kind == DENSE_F16 ? f16_to_f32(h[t + c]) : bf16_to_f32(h[t + c])) * x[t + c];
    for (int c = 0; c < 16; c++) sum += acc[c];
    return sum;
}

/* y[i, r] for a dense weight row: dense_dot, the LoRA term added, one rounding. */
static void dense_row(const job_t *j, int64_t r) {
    const void *w = (const char *)j->dense + r * j->d_stride * (j->dense_kind == DENSE_F32 ? 4 : 2);
    for (int64_t i = 0; i < j->m; i++) {
        float sum = dense_dot(w, j->x + i * j->k, j->k, j->dense_kind, j->scalar);
        if (j->lora_b != NULL) sum += dot(j->xa + i * j->rank, j->lora_b + r * j->rank, j->rank);
        store(j->y, i * j->n + r, sum, j->dtype);
    }
}

/* y[i, r] = sum_k x[i, k] * w[r, k] for the m rows of x, one weight row r at a time, the weight never written out:
 * each block's 16 values come from the fp32 table, are multiplied by x and added into 16 fp32 lanes (portable: 16
 * scalar accumulators in the same order), and the lanes are summed at the end. */
static void linear_row(const job_t *j, int64_t r) {
    const int64_t nblocks = j->k / 16;
    const uint8_t *q = j->qdata + r * j->q_stride, *s = j->scale + r * j->s_stride;
    const float *table = (const float *)j->table;
    for (int64_t i = 0; i < j->m; i++) {
        const float *x = j->x + i * j->k;
        float sum = 0.0f;
#ifdef PACT_AVX512
        if (!j->scalar) {
            const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
            __m512 acc = _mm512_setzero_ps();
            for (int64_t b = 0; b < nblocks; b++) {
                __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + b * 8));
                __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(bytes, bytes)), shifts);
                __m512 w = _mm512_permutexvar_ps(idx, _mm512_loadu_ps(table + 16 * s[b]));
                acc = _mm512_add_ps(acc, _mm512_mul_ps(w, _mm512_loadu_ps(x + b * 16)));
            }
            sum = _mm512_reduce_add_ps(acc);
            if (j->lora_b != NULL) sum += dot(j->xa + i * j->rank, j->lora_b + r * j->rank, j->rank);
            store(j->y, i * j->n + r, sum, j->dtype);
            continue;
        }
#endif
#ifdef PACT_AVX2
        if (!j->scalar) {
            if (j->lora_b != NULL)
                sum = dot_avx2(q, s, j->sc, j->xp + i * j->k, nblocks, j->xa + i * j->rank, j->lora_b + r * j->rank,
                               j->rank);
            else
                sum = dot_avx2(q, s, j->sc, j->xp + i * j->k, nblocks, NULL, NULL, 0);
            store(j->y, i * j->n + r, sum, j->dtype);
            continue;
        }
#endif
        float acc[16] = {0};
        for (int64_t b = 0; b < nblocks; b++) {
            const float *t = table + 16 * s[b];
            for (int c = 0; c < 16; c++) {
                const uint8_t byte = q[b * 8 + c / 2];
                acc[c] += t[c % 2 ? byte >> 4 : byte & 0xF] * x[b * 16 + c];
            }
        }
        for (int c = 0; c < 16; c++) sum += acc[c];
        if (j->lora_b != NULL) sum += dot(j->xa + i * j->rank, j->lora_b + r * j->rank, j->rank);
        store(j->y, i * j->n + r, sum, j->dtype);
    }
}

static void work(job_t *j) {
    const int64_t nblocks = j->k / 16, esize = j->dtype == OUT_F32 ? 4 : 2;
    for (;;) {
        const int64_t c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (c >= j->nchunks) return;
        for (int64_t r = c * j->chunk; r < j->n && r < (c + 1) * j->chunk; r++) {
            if (j->x != NULL) {
                if (j->dense != NULL) dense_row(j, r);
                else linear_row(j, r);
                continue;
            }
            const uint8_t *q = j->qdata + r * j->q_stride, *s = j->scale + r * j->s_stride;
            void *o = (char *)j->out + r * j->k * esize;
#ifdef PACT_AVX512
            if (!j->scalar) {
                if (j->dtype == OUT_F32) row_avx512(q, s, j->table, nblocks, o, OUT_F32);
                else row_avx512(q, s, j->table, nblocks, o, OUT_BF16); /* bf16 and fp16 differ only in the table */
                continue;
            }
#endif
#ifdef PACT_AVX2
            if (!j->scalar) {
                if (j->dtype == OUT_F32) row_avx2(q, s, j->table, j->split, nblocks, o, OUT_F32);
                else row_avx2(q, s, j->table, j->split, nblocks, o, OUT_BF16);
                continue;
            }
#endif
            if (j->dtype == OUT_F32) row_scalar(q, s, j->table, nblocks, o, OUT_F32);
            else row_scalar(q, s, j->table, nblocks, o, OUT_BF16);
        }
    }
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* Calls run on one thread until this time (ns): recent teams waited too long for their threads. */
static atomic_llong solo_until;
/* When the last team waited too long, and how many teams in a row did so with less than 100 ms between them. */
static atomic_llong last_late;
static atomic_int late_run;

/* Run a job on an OpenMP team (the runtime torch's CPU ops use, so its threads are usually awake and start at once)
 * whose threads claim chunks. A team cannot finish before all its threads have turned up, and on a machine shared
 * with other work a thread may wait milliseconds for a core: measured on 2 busy cores, 5 ms for a 0.1 ms job,
 * which doubled a linear layer's training step. So when three teams in a row turn up more than 200 us late, each
 * within 100 ms of the last, the calls of the next second run on one thread (no team, no wait), then a team is
 * tried again. A single late team is not enough: on a VM whose host takes a core away now and then (steal), one
 * call in a thousand waited 0.2-2 ms while decoding, and a second on one thread cost far more than those waits. */
static void run(job_t *j, int nthreads) {
    const int64_t start = now_ns();
    atomic_llong latest;
    atomic_init(&latest, start);
    if (nthreads > 1 && start < atomic_load_explicit(&solo_until, memory_order_relaxed)) nthreads = 1;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int64_t seen = atomic_load_explicit(&latest, memory_order_relaxed), arrival = now_ns();
        while (arrival > seen && !atomic_compare_exchange_weak(&latest, &seen, arrival)) {
        }
        work(j);
    }
    if (nthreads > 1 && atomic_load(&latest) - start > 200000) {
        const int64_t t = now_ns();
        const int run = t - atomic_exchange(&last_late, t) < 100000000 ? atomic_fetch_add(&late_run, 1) + 1 : 1;
        if (run == 1) atomic_store(&late_run, 1);
        if (run >= 3) {
            atomic_store(&late_run, 0);
            atomic_store_explicit(&solo_until, t + 1000000000, memory_order_relaxed);
        }
    }
}

/* Every value a block can take, [scale byte][code], with the reference's own two fp32 multiplies. */
static void fp32_table(float scale_2, float *t32, float *sc) {
    for (int byte = 0; byte < 256; byte++) sc[byte] = e4m3_to_f32((uint8_t)byte);
    for (int byte = 0; byte < 256; byte++)
        for (int c = 0; c < 16; c++) t32[byte * 16 + c] = (E2M1[c] * sc[byte]) * scale_2;
}

/* Whether this build has the AVX-512 path (for tests and diagnostics). */
int pact_nvfp4_has_avx512(void) {
#ifdef PACT_AVX512
    return 1;
#else
    return 0;
#endif
}

/* Whether this build has the AVX2 path (built where AVX-512 is missing). */
int pact_nvfp4_has_avx2(void) {
#ifdef PACT_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Dequantize n rows of k elements (k % 16 == 0) into a contiguous [n, k] output; strides are in elements.
 * dtype: 0 fp32, 1 bf16, 2 fp16. scalar != 0 forces the portable path. nthreads: threads to use.
 * Returns 0, or -1 on bad arguments. */
int pact_nvfp4_dequantize(const uint8_t *qdata, int64_t q_stride, const uint8_t *scale, int64_t s_stride,
                          float scale_2, int64_t n, int64_t k, void *out, int dtype, int scalar, int nthreads) {
    float t32[256 * 16] __attribute__((aligned(64))), sc[256];
    uint16_t t16[256 * 16] __attribute__((aligned(64)));
    if (k <= 0 || k % 16 || n < 0 || nthreads < 1 || dtype < 0 || dtype > 2) return -1;
    /* every value a block can take: the reference's two fp32 multiplies, then the output rounding
     * (plain loops the compiler vectorizes: the whole table costs about a microsecond) */
    fp32_table(scale_2, t32, sc);
    if (dtype == OUT_BF16)
        for (int i = 0; i < 256 * 16; i++) t16[i] = f32_to_bf16(t32[i]);
    if (dtype == OUT_F16) {
        int i = 0;
#ifdef PACT_AVX512
        for (; !scalar && i < 256 * 16; i += 16) /* vcvtps2ph: the same rounding, 16 at a time */
            _mm256_store_si256((__m256i *)(t16 + i), _mm512_cvtps_ph(_mm512_load_ps(t32 + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < 256 * 16; i++) t16[i] = f32_to_f16(t32[i]);
    }
    uint8_t split[256 * 32];
    for (int i = 0; dtype != OUT_F32 && i < 256 * 16; i++) {
        split[(i / 16) * 32 + i % 16] = (uint8_t)(t16[i] & 0xFF);
        split[(i / 16) * 32 + 16 + i % 16] = (uint8_t)(t16[i] >> 8);
    }
    job_t j;
    memset(&j, 0, sizeof j);
    j.qdata = qdata, j.scale = scale, j.out = out, j.table = dtype == OUT_F32 ? (void *)t32 : (void *)t16;
    j.split = split;
    j.q_stride = q_stride, j.s_stride = s_stride, j.n = n, j.k = k, j.dtype = dtype, j.scalar = scalar;
    j.chunk = k >= 16384 ? 1 : 16384 / k; /* chunks of ~16K elements */
    j.nchunks = (n + j.chunk - 1) / j.chunk;
    atomic_init(&j.next, 0);
    run(&j, n * (k / 16) >= 4096 ? nthreads : 1); /* below ~64K elements a second thread costs more than it saves */
    return 0;
}

/* A packed weight bound for the fused product (pact_nvfp4_linear), filled once by the caller: qdata uint8 [n, k/2]
 * and scale e4m3 [n, k/16] with row strides in elements, scale_2, and an optional LoRA adapter: lora_a fp32
 * [rank, k] and lora_b fp32 [n, rank] contiguous (both NULL for none), whose term is scaled by `scaling`.
 * block_scale: fp32(fp32(e4m3 byte) * scale_2) / 2 for each of the 256 scale bytes (the AVX2 path's factor). */
typedef struct {
    const uint8_t *qdata, *scale;
    const float *block_scale;
    int64_t q_stride, s_stride, n, k;
    const float *lora_a, *lora_b;
    int64_t rank;
    float scale_2, scaling;
    int32_t scalar; /* != 0: the portable (non-SIMD) code, for tests */
    const void *dense; /* != NULL: a dense weight [n, k] with row stride d_stride instead of qdata / scale */
    int64_t d_stride;
    int32_t dense_kind; /* its dtype: 0 bf16, 1 fp16 (a layer kept 16-bit), 2 fp32 (an output head) */
} pact_linear_t;

/* The fused product for few rows (decoding): y [m, n] = x [m, k] @ deq(W).T, W read packed and never dequantized
 * to memory, sums in fp32. x and y are contiguous, in `dtype` (0 fp32, 1 bf16, 2 fp16; y rounded to nearest even).
 * With an adapter, the LoRA term of the same rows is added before the rounding: y += scaling * (x @ A.T) @ B.T.
 * With `dense` set, W is that dense weight instead (a layer kept 16-bit, an output head), read the same way.
 * Returns 0, -1 on bad arguments, -2 out of memory. */
int pact_nvfp4_linear(const pact_linear_t *w, const void *x, int64_t m, void *y, int dtype, int nthreads) {
    const uint8_t *qdata = w->qdata, *scale = w->scale;
    const int64_t q_stride = w->q_stride, s_stride = w->s_stride, n = w->n, k = w->k, rank = w->rank;
    const float *lora_a = w->lora_a, *lora_b = w->lora_b, scale_2 = w->scale_2, scaling = w->scaling;
    const int scalar = w->scalar;
    float t32[256 * 16] __attribute__((aligned(64))), sc[256];
    if (k <= 0 || k % 16 || n < 0 || m < 1 || nthreads < 1 || dtype < 0 || dtype > 2) return -1;
    if (w->dense != NULL && (w->dense_kind < DENSE_BF16 || w->dense_kind > DENSE_F32)) return -1;
    if (lora_b != NULL && (lora_a == NULL || rank < 1)) return -1;
    int reorder = 0; /* the AVX2 path reads x reordered per block and the block scales, not the value table */
#ifdef PACT_AVX2
    reorder = !scalar && w->dense == NULL;
#endif
    if (!reorder && w->dense == NULL) fp32_table(scale_2, t32, sc);
    const int64_t nx = dtype != OUT_F32 ? m * k : 0, nxa = lora_b != NULL ? m * rank : 0, nxp = reorder ? m * k : 0;
    float *buf = NULL, *xa = NULL, *xp = NULL;
    const float *xf = (const float *)x;
    if (nx + nxa + nxp > 0) {
        buf = malloc(sizeof(float) * (size_t)(nx + nxa + nxp));
        if (buf == NULL) return -2;
    }
    if (dtype != OUT_F32) {
        const uint16_t *h = (const uint16_t *)x;
        for (int64_t i = 0; i < m * k; i++) buf[i] = dtype == OUT_BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
        xf = buf;
    }
    if (lora_b != NULL) {
        xa = buf + nx;
        for (int64_t i = 0; i < m; i++)
            for (int64_t t = 0; t < rank; t++) xa[i * rank + t] = scaling * dot(xf + i * k, lora_a + t * k, k);
    }
#ifdef PACT_AVX2
    if (reorder) { /* in dot_avx2's order: groups of 4 blocks (group_slot), then blocks of evens then odds */
        xp = buf + nx + nxa;
        const int64_t grouped = k / 64 * 64;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = xf + i * k;
            float *pi = xp + i * k;
            for (int64_t p = 0; p < grouped; p++) pi[p / 64 * 64 + group_slot(p % 64)] = xi[p];
            for (int64_t e = grouped; e < k; e += 16)
                for (int c = 0; c < 8; c++) pi[e + c] = xi[e + 2 * c], pi[e + 8 + c] = xi[e + 2 * c + 1];
        }
    }
#endif
    job_t j;
    memset(&j, 0, sizeof j);
    j.qdata = qdata, j.scale = scale, j.table = t32, j.q_stride = q_stride, j.s_stride = s_stride;
    j.n = n, j.k = k, j.dtype = dtype, j.scalar = scalar, j.x = xf, j.y = y, j.m = m;
    j.xa = xa, j.lora_b = lora_b, j.rank = rank, j.sc = w->block_scale, j.xp = xp;
    j.dense = w->dense, j.d_stride = w->d_stride, j.dense_kind = w->dense_kind;
    j.chunk = 64; /* rows of W a thread claims at a time */
    j.nchunks = (n + j.chunk - 1) / j.chunk;
    atomic_init(&j.next, 0);
    run(&j, n * (k / 16) * m >= 4096 ? nthreads : 1);
    free(buf);
    return 0;
}

/* Rows of a table in a file, read with pread (never through a mapping of it): out[i] = file[base + rows[i] * row_bytes,
 * + row_bytes). Used by the memory savers' weight streaming (optimum_pact/memory/streaming.py) to gather the output
 * head's / embedding's rows without the page faults that would map whole page-cache folios around each row. Returns
 * the number of rows read in full: less than n means a short read (the file was cut) or an error (errno). */
int64_t pact_pread_rows(int fd, const int64_t *rows, int64_t n, int64_t row_bytes, int64_t base, char *out) {
    for (int64_t i = 0; i < n; i++) {
        int64_t done = 0;
        while (done < row_bytes) {
            off_t at = (off_t)(base + rows[i] * row_bytes + done);
            ssize_t got = pread(fd, out + i * row_bytes + done, (size_t)(row_bytes - done), at);
            if (got <= 0) return i;
            done += got;
        }
    }
    return n;
}
