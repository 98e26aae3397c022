/* y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] for int8 weights w [N, K] and fp32 rows x [M, K]:
 * the CPU's few-row product of int8 weights (engine.models.cpu.Int8), at the bandwidth of its bytes.
 *
 * Every output is one fp32 sum over k in a fixed order (8 partial sums over k mod 8, then added
 * pairwise), whatever M, the tiling or the thread count: a row's result does not depend on the
 * rest of the batch. Threads (OpenMP: torch's own runtime, loaded before this library) split the
 * weight rows, four at a time (independent sums that hide the FMA latency at one row of x).
 * Compiled at first use for the CPU it runs on (engine/models/int8_gemv.py).
 */
#include <stdint.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float finish(const float *p) {
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

/* out[c] = sum_k x[k] * w[c * K + k] for c < C (any C: the tail of the weight rows; and no AVX2) */
static void dot_any(const float *x, const int8_t *w, int64_t K, int C, float *out) {
    for (int c = 0; c < C; c++) {
        float p[8] = {0};
        for (int64_t k = 0; k < K; k++) p[k % 8] += x[k] * (float)w[c * K + k];
        out[c] = finish(p);
    }
}

#ifdef __AVX2__
#define PREFETCH_TILES 4

static inline __m256 widen(const int8_t *w) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

/* out[c] = sum_k x[k] * w[c * K + k] for c < 4, K a multiple of 8: the same sums as dot_any's.
 * Four rows read side by side are four short streams (SmolLM2's rows are 576 bytes) that the
 * hardware prefetcher does not follow: the tile PREFETCH_TILES ahead is prefetched as we go. */
static void dot4(const float *x, const int8_t *w, int64_t K, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const char *ahead = (const char *)(w + PREFETCH_TILES * 4 * K);
    for (int64_t k = 0; k < K; k += 8) {
        _mm_prefetch(ahead + 4 * k, _MM_HINT_T0);
        __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(xv, widen(w + k), a0);
        a1 = _mm256_fmadd_ps(xv, widen(w + K + k), a1);
        a2 = _mm256_fmadd_ps(xv, widen(w + 2 * K + k), a2);
        a3 = _mm256_fmadd_ps(xv, widen(w + 3 * K + k), a3);
    }
    float p[4][8];
    _mm256_storeu_ps(p[0], a0), _mm256_storeu_ps(p[1], a1), _mm256_storeu_ps(p[2], a2), _mm256_storeu_ps(p[3], a3);
    for (int c = 0; c < 4; c++) out[c] = finish(p[c]);
}
#endif

void int8_gemv(const float *x, const int8_t *w, const float *scale, float *y,
               int64_t M, int64_t N, int64_t K, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n += 4) {
        int C = N - n < 4 ? (int)(N - n) : 4;
        float out[4];
        for (int64_t m = 0; m < M; m++) {
#ifdef __AVX2__
            if (C == 4 && K % 8 == 0)
                dot4(x + m * K, w + n * K, K, out);
            else
#endif
                dot_any(x + m * K, w + n * K, K, C, out);
            for (int c = 0; c < C; c++) y[m * N + n + c] = out[c] * scale[n + c];
        }
    }
}
