/* kvgate's CPU kernels (engine/models/cpu_kernels.py compiles them at first use for the CPU it
 * runs on and calls them through ctypes). Threads: OpenMP, torch's own runtime (loaded before this
 * library). Every output is computed in a fixed order whatever the batch or the thread count.
 *
 * int8_gemv: y[m, n] = scale[n] * sum_k x[m, k] * w[n, k] for int8 weights w [N, K] and fp32 rows
 * x [M, K], the few-row product of engine.models.cpu.Int8, at the bandwidth of its bytes: each
 * output one fp32 sum over k (8 partial sums over k mod 8, then added pairwise); the threads split
 * the weight rows, four at a time (independent sums that hide the FMA latency at one row of x), each
 * tile against two rows of x at once while there are two.
 * rms_norm, silu_and_mul, decode_attention: a decode step's small ops in fp32. int8_decoder_stack: a
 * Llama decoder's whole decode step over them, in one parallel region (engine.models.cpu.Int8DecoderStack).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

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

/* out[r * 4 + c] = sum_k x[r * K + k] * w[c * K + k] for r < R (1 or 2: a constant once inlined), c < 4,
 * K a multiple of 8: the same sums as dot_any's, each row's whatever R. Two rows widen each weight
 * vector once for both (the widening, not the bytes, bounds a product of several rows: the 4 x K tile
 * stays in L1). Four rows read side by side are four short streams (SmolLM2's rows are 576 bytes)
 * that the hardware prefetcher does not follow: the tile PREFETCH_TILES ahead is prefetched as we go. */
static inline __attribute__((always_inline)) void dot4_rows(const float *x, const int8_t *w, int64_t K, int R,
                                                            float *out) {
    __m256 acc[2][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_ps();
    const char *ahead = (const char *)(w + PREFETCH_TILES * 4 * K);
    for (int64_t k = 0; k < K; k += 8) {
        _mm_prefetch(ahead + 4 * k, _MM_HINT_T0);
        __m256 xv[2];
        for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * K + k);
        for (int c = 0; c < 4; c++) {
            __m256 wv = widen(w + c * K + k);
            for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
        }
    }
    float p[8];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 4; c++) {
            _mm256_storeu_ps(p, acc[r][c]);
            out[r * 4 + c] = finish(p);
        }
}
#endif

/* The rows of y = x @ (w * scale[:, None]).T, four weight rows by two rows of x at a time: inside a
 * parallel region the team shares them (an orphaned `omp for`, with its barrier at the end), outside
 * one thread does all. dot4_rows is called with a literal R, so that each call inlines unrolled. */
static void gemv_team(const float *x, const int8_t *w, const float *scale, float *y, int64_t M, int64_t N, int64_t K) {
    #pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n += 4) {
        int C = N - n < 4 ? (int)(N - n) : 4;
        float out[8];
        for (int64_t m = 0; m < M;) {
            int R = 1;
#ifdef __AVX2__
            if (C == 4 && K % 8 == 0) {
                R = M - m >= 2 ? 2 : 1;
                if (R == 2)
                    dot4_rows(x + m * K, w + n * K, K, 2, out);
                else
                    dot4_rows(x + m * K, w + n * K, K, 1, out);
            } else
#endif
                dot_any(x + m * K, w + n * K, K, C, out);
            for (int r = 0; r < R; r++, m++)
                for (int c = 0; c < C; c++) y[m * N + n + c] = out[r * 4 + c] * scale[n + c];
        }
    }
}

void int8_gemv(const float *x, const int8_t *w, const float *scale, float *y,
               int64_t M, int64_t N, int64_t K, int threads) {
    #pragma omp parallel num_threads(threads)
    gemv_team(x, w, scale, y, M, N, K);
}

/* ---- the small ops of a decode step, each one call instead of torch's 4-40 (fp32) ---------------- */

/* 8 partial sums over i mod 8, added pairwise: sum_i a[i] * b[i] */
static inline float dot(const float *a, const float *b, int64_t n) {
    float p[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) p[j] += a[i + j] * b[i + j];
    for (; i < n; i++) p[i % 8] += a[i] * b[i];
    return finish(p);
}

/* out = r * rsqrt(mean of r's squares + eps) * weight for the row r = x + add, stored in sum (r = x when
 * add is NULL) */
static void norm_row(const float *x, const float *add, const float *weight, float eps, int64_t H, float *out,
                     float *sum) {
    const float *r = x;
    if (add) {
        for (int64_t i = 0; i < H; i++) sum[i] = x[i] + add[i];
        r = sum;
    }
    float inv = 1.0f / sqrtf(dot(r, r, H) / (float)H + eps);
    for (int64_t i = 0; i < H; i++) out[i] = r[i] * inv * weight[i];
}

/* residual_out = x + residual (x alone when residual is NULL); out = residual_out * rsqrt(mean of its
 * squares + eps) * weight; rows of H, contiguous. */
void rms_norm(const float *x, const float *residual, const float *weight, float eps, float *out,
              float *residual_out, int64_t T, int64_t H, int threads) {
    #pragma omp parallel for if (T > 1) num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++)
        norm_row(x + t * H, residual ? residual + t * H : NULL, weight, eps, H, out + t * H, residual_out + t * H);
}

/* out[i] = silu(x[i]) * x[d + i] for a row of 2d */
static void silu_row(const float *x, float *out, int64_t d) {
    for (int64_t i = 0; i < d; i++) {
        float g = x[i];
        out[i] = g / (1.0f + expf(-g)) * x[d + i];
    }
}

void silu_and_mul(const float *x, float *out, int64_t T, int64_t d, int threads) {
    #pragma omp parallel for if (T > 1) num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; t++) silu_row(x + t * 2 * d, out + t * d, d);
}

/* rotate-half RoPE of one head x[D] at cos/sin cs[D] (cos first, sin second) into out */
static inline void rope(const float *x, const float *cs, int64_t D, float *out) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * cs[i] - x[i + half] * cs[half + i];
        out[i + half] = x[i + half] * cs[i] + x[i] * cs[half + i];
    }
}

#define AHEAD 8

/* A decode batch: one new token per sequence (kernels' decode_attention contract, an fp32 cache of
 * pages of BS slots, each slot KV heads of D floats); q/k/v rows `row_stride` floats apart (views of a
 * fused qkv), heads D apart. */
typedef struct {
    const int64_t *positions, *slots;
    const float *cos_sin;
    const int32_t *block_tables, *seq_lens;
    int64_t max_blocks, row_stride, S, NH, KV, D, BS;
    float scale;
} decode_batch;

/* RoPE of each sequence's new k, stored with its v at the sequence's slot (a padding row's < 0) */
static void store_kv(const decode_batch *b, const float *k, const float *v, float *k_cache, float *v_cache) {
    int64_t token = b->KV * b->D, D = b->D; /* floats per cache slot */
    for (int64_t s = 0; s < b->S; s++) {
        int64_t slot = b->slots[s];
        if (slot < 0) continue;
        const float *cs = b->cos_sin + b->positions[s] * D;
        for (int64_t h = 0; h < b->KV; h++) {
            rope(k + s * b->row_stride + h * D, cs, D, k_cache + slot * token + h * D);
            for (int64_t i = 0; i < D; i++) v_cache[slot * token + h * D + i] = v[s * b->row_stride + h * D + i];
        }
    }
}

/* Attention of sequence task / KV's q heads that share kv head task % KV, over the sequence's pages
 * (its last `window` keys when window > 0), into their rows of out [S, NH, D]: each key and value row
 * read once for the group. A padding row gets zeros. */
static void attend(const decode_batch *b, int64_t task, const float *q, const float *k_cache, const float *v_cache,
                   int64_t window, float *out) {
    int64_t KV = b->KV, D = b->D, BS = b->BS, token = KV * D, group = b->NH / KV;
    int64_t s = task / KV, kvh = task % KV;
    const int32_t *table = b->block_tables + s * b->max_blocks;
    float *o = out + (s * b->NH + kvh * group) * D;
    for (int64_t i = 0; i < group * D; i++) o[i] = 0.0f;
    if (b->slots[s] < 0) return;
    int64_t len = b->seq_lens[s], first = window > 0 && len > window ? len - window : 0, n = len - first;
    float *qr = malloc(sizeof(float) * group * (D + n + 2)), *scores = qr + group * D;
    float *top = scores + group * n, *total = top + group;
    for (int64_t g = 0; g < group; g++) {
        rope(q + s * b->row_stride + (kvh * group + g) * D, b->cos_sin + b->positions[s] * D, D, qr + g * D);
        top[g] = -INFINITY, total[g] = 0.0f;
    }
    for (int64_t j = 0; j < n; j++) {
        int64_t key = first + j, slot = (int64_t)table[key / BS] * BS + key % BS;
        const float *kj = k_cache + slot * token + kvh * D;
        if (j + AHEAD < n) { /* the pages' rows are short strided runs: fetch the row AHEAD keys on */
            int64_t next = key + AHEAD, at = (int64_t)table[next / BS] * BS + next % BS;
            for (int64_t i = 0; i < D; i += 16) {
                __builtin_prefetch(k_cache + at * token + kvh * D + i);
                __builtin_prefetch(v_cache + at * token + kvh * D + i);
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float score = dot(qr + g * D, kj, D) * b->scale;
            scores[g * n + j] = score;
            top[g] = score > top[g] ? score : top[g];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t j = 0; j < n; j++) {
            scores[g * n + j] = expf(scores[g * n + j] - top[g]);
            total[g] += scores[g * n + j];
        }
    for (int64_t j = 0; j < n; j++) {
        int64_t key = first + j, slot = (int64_t)table[key / BS] * BS + key % BS;
        const float *restrict vj = v_cache + slot * token + kvh * D;
        for (int64_t g = 0; g < group; g++) {
            float p = scores[g * n + j], *restrict og = o + g * D;
            for (int64_t i = 0; i < D; i++) og[i] += p * vj[i];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t i = 0; i < D; i++) o[g * D + i] /= total[g];
    free(qr);
}

/* RoPE of q and k, k and v stored at the slots, attention over the pages (decode_batch, attend).
 * Threads split (sequence, kv head) pairs when there is enough work to pay for waking them. */
void decode_attention(const float *q, const float *k, const float *v, int64_t row_stride,
                      const int64_t *positions, const float *cos_sin, float *k_cache, float *v_cache,
                      const int64_t *slots, const int32_t *block_tables, int64_t max_blocks,
                      const int32_t *seq_lens, float scale, int64_t window, float *out,
                      int64_t S, int64_t NH, int64_t KV, int64_t D, int64_t BS, int threads) {
    decode_batch b = {positions, slots, cos_sin, block_tables, seq_lens, max_blocks, row_stride, S, NH, KV, D, BS,
                      scale};
    store_kv(&b, k, v, k_cache, v_cache);
    int64_t longest = 0;
    for (int64_t s = 0; s < S; s++) longest = seq_lens[s] > longest ? seq_lens[s] : longest;
    int parallel = S * NH * longest * D >= (1 << 18);
    #pragma omp parallel for if (parallel) num_threads(threads) schedule(dynamic, 1)
    for (int64_t task = 0; task < S * KV; task++) attend(&b, task, q, k_cache, v_cache, window, out);
}

/* ---- a Llama decoder's decode step in one call ---------------------------------------------------- */

/* One Llama decoder layer's weights (int8 rows over fp32 per-row scales), cache and window */
typedef struct {
    const float *input_norm, *post_norm;
    const int8_t *qkv, *o, *gate_up, *down;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
    float *k_cache, *v_cache;
    int64_t window;
} int8_layer;

/* The decode step of a stack of L Llama layers and the final norm over the embedded tokens x [S, H]
 * into out [S, H]: the ops of engine.models.llama with the kernels above, in the same order, so the
 * result is theirs bit for bit; one parallel region for all (the threads wait at each op's end
 * instead of being woken for each of a layer's ~8 ops). I: the MLP's intermediate size. */
void int8_decoder_stack(const int8_layer *layers, int64_t L, const float *final_norm, float eps, const float *x,
                        float *out, const int64_t *positions, const float *cos_sin, const int64_t *slots,
                        const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, float scale,
                        int64_t S, int64_t H, int64_t NH, int64_t KV, int64_t D, int64_t I, int64_t BS,
                        int threads) {
    int64_t Q = (NH + 2 * KV) * D;
    decode_batch b = {positions, slots, cos_sin, block_tables, seq_lens, max_blocks, Q, S, NH, KV, D, BS, scale};
    float *residual = malloc(sizeof(float) * S * (3 * H + Q + NH * D + 3 * I));
    float *hidden = residual + S * H, *normed = hidden + S * H, *qkv = normed + S * H, *att = qkv + S * Q;
    float *gate_up = att + S * NH * D, *act = gate_up + S * 2 * I;
    #pragma omp parallel num_threads(threads)
    for (int64_t l = 0; l < L; l++) {
        const int8_layer *layer = layers + l;
        #pragma omp single
        for (int64_t s = 0; s < S; s++) {
            if (l == 0) /* the first layer's residual is the embedding */
                for (int64_t i = 0; i < H; i++) residual[s * H + i] = x[s * H + i];
            norm_row(l ? hidden + s * H : residual + s * H, l ? residual + s * H : NULL, layer->input_norm, eps,
                     H, normed + s * H, residual + s * H);
        }
        gemv_team(normed, layer->qkv, layer->qkv_scale, qkv, S, Q, H);
        #pragma omp single
        store_kv(&b, qkv + NH * D, qkv + (NH + KV) * D, layer->k_cache, layer->v_cache);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < S * KV; task++)
            attend(&b, task, qkv, layer->k_cache, layer->v_cache, layer->window, att);
        gemv_team(att, layer->o, layer->o_scale, hidden, S, H, NH * D);
        #pragma omp single
        for (int64_t s = 0; s < S; s++)
            norm_row(hidden + s * H, residual + s * H, layer->post_norm, eps, H, normed + s * H, residual + s * H);
        gemv_team(normed, layer->gate_up, layer->gate_up_scale, gate_up, S, 2 * I, H);
        #pragma omp single
        for (int64_t s = 0; s < S; s++) silu_row(gate_up + s * 2 * I, act + s * I, I);
        gemv_team(act, layer->down, layer->down_scale, hidden, S, H, I);
    }
    for (int64_t s = 0; s < S; s++)
        norm_row(hidden + s * H, residual + s * H, final_norm, eps, H, out + s * H, residual + s * H);
    free(residual);
}
