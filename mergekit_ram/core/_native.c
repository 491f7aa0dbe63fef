/* Fused CPU loops for the RAM / RAM+ kernel (see kernel.py for the math).
 *
 * The torch path makes ~8 passes over memory per agent; these loops make one:
 * each block of BLOCK entries keeps the base (as float), the running sums and
 * the hit count in L1 while every agent streams through once. Same masks
 * (|tau| > eps on float32 deltas), same float32 arithmetic, output rounded
 * once (round to nearest even). Compiled on first use by native.py.
 *
 * Keep libm calls out of the loops: without -ffast-math gcc emits fmaxf as a
 * call, which stops vectorisation (the merge loop ran 4.7x slower with one).
 * native.py compiles with -fno-trapping-math: without it gcc 12 keeps the
 * selects (`on ? d : 0`, `c == 1 ? scaled : mean`) as branches and the merge
 * loops stay scalar (8x slower on random masks). It only drops the promise to
 * raise FP exception flags; every value and rounding is unchanged (-O3 alone
 * never reassociates, and -ffp-contract=off keeps a*b+c unfused).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 2048
_Static_assert(BLOCK <= 65535, "per-block counters are uint16_t");

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline float load_f16(const _Float16 *p, int64_t i) { return (float)p[i]; }

static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }
static inline void store_bf16(uint16_t *p, int64_t i, float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    p[i] = (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? 0x7fc0u : r);
}
static inline void store_f16(_Float16 *p, int64_t i, float x) { p[i] = (_Float16)x; }

/* The smallest |x| a store_* rounds to an infinity (round to nearest even: the halfway point above the
 * largest finite value rounds up, as its last bit is odd); NaN is no less. merge_* checks each float32
 * result against its output's where it computes it, so the one rounding is the one checked (in the loop
 * that stores it instead, the check cost 3-13% of the merge loop's CPU time; here, within 2%). */
#define OVER_f32 INFINITY       /* float32 results are stored as they are */
#define OVER_bf16 0x1.ffp127f   /* bits 0x7f7f8000: 0x7f7f (the largest) + half a step */
#define OVER_f16 65520.0f       /* 65504 (the largest) + half of its step of 32 */

/* count_* and diagnose_* return 0; 1 when any delta is NaN or Inf (the caller then names the
 * input); NO_MEMORY when their scratch cannot be allocated (the caller names its size:
 * count_scratch, diagnose_scratch). merge_* returns 1 for a delta that is NaN or Inf, | 2 for a
 * result that is not finite in its output dtype (the caller names the entry). */
#define NO_MEMORY -1

/* Scratch per call for n agents: one mask byte per entry of a block, and (diagnose_*) one
 * float32 delta per entry of a block. */
static size_t mask_bytes(int n) { return (size_t)n * BLOCK; }
static size_t delta_bytes(int n) { return (size_t)n * BLOCK * sizeof(float); }
int64_t count_scratch(int n) { return (int64_t)mask_bytes(n); }
int64_t diagnose_scratch(int n) { return (int64_t)(mask_bytes(n) + delta_bytes(n)); }

#define DEFINE_COUNT(NAME, T)                                                          \
    int count_##NAME(const T *base, const T *const *agents, int n, float eps,          \
                     int64_t len, int64_t *counts) {                                   \
        float b[BLOCK];                                                                \
        uint8_t hits[BLOCK];                                                           \
        uint8_t *mask = malloc(mask_bytes(n));                                         \
        int bad = 0;                                                                   \
        if (!mask) return NO_MEMORY;                                                   \
        for (int64_t s = 0; s < len; s += BLOCK) {                                     \
            int k = (len - s) < BLOCK ? (int)(len - s) : BLOCK;                        \
            for (int i = 0; i < k; i++) {                                              \
                b[i] = load_##NAME(base, s + i);                                       \
                hits[i] = 0;                                                           \
            }                                                                          \
            for (int t = 0; t < n; t++) {                                              \
                const T *a = agents[t] + s;                                            \
                uint8_t *m = mask + (size_t)t * BLOCK;                                 \
                for (int i = 0; i < k; i++) {                                          \
                    float d = fabsf(load_##NAME(a, i) - b[i]);                         \
                    bad |= !(d <= FLT_MAX);                                            \
                    m[i] = d > eps;                                                    \
                    hits[i] += m[i];                                                   \
                }                                                                      \
            }                                                                          \
            for (int t = 0; t < n; t++) {                                              \
                const uint8_t *m = mask + (size_t)t * BLOCK;                           \
                uint16_t act = 0, uni = 0, pair = 0;                                   \
                for (int i = 0; i < k; i++) {                                          \
                    act += m[i];                                                       \
                    uni += m[i] & (hits[i] == 1);                                      \
                    pair += m[i] & (hits[i] == 2);                                     \
                }                                                                      \
                counts[3 * t] += act;                                                  \
                counts[3 * t + 1] += uni;                                              \
                counts[3 * t + 2] += pair;                                             \
            }                                                                          \
        }                                                                              \
        free(mask);                                                                    \
        return bad;                                                                    \
    }

#define DEFINE_MERGE(NAME, T, ONAME, O)                                                \
    int merge_##NAME##_##ONAME(const T *base, const T *const *agents, int n,           \
                               const float *lambdas, float eps, int64_t len, O *out) { \
        float b[BLOCK], total[BLOCK], scaled[BLOCK], hits[BLOCK];                      \
        int bad = 0, over = 0;                                                         \
        for (int64_t s = 0; s < len; s += BLOCK) {                                     \
            int k = (len - s) < BLOCK ? (int)(len - s) : BLOCK;                        \
            for (int i = 0; i < k; i++) {                                              \
                b[i] = load_##NAME(base, s + i);                                       \
                total[i] = 0.0f;                                                       \
                scaled[i] = 0.0f;                                                      \
                hits[i] = 0.0f;                                                        \
            }                                                                          \
            for (int t = 0; t < n; t++) {                                              \
                const T *a = agents[t] + s;                                            \
                float lam = lambdas[t];                                                \
                for (int i = 0; i < k; i++) {                                          \
                    float d = load_##NAME(a, i) - b[i];                                \
                    float ad = fabsf(d);                                               \
                    bad |= !(ad <= FLT_MAX);                                           \
                    int on = ad > eps;                                                 \
                    float kept = on ? d : 0.0f;                                        \
                    total[i] += kept;                                                  \
                    scaled[i] += lam * kept;                                           \
                    hits[i] += on ? 1.0f : 0.0f;                                       \
                }                                                                      \
            }                                                                          \
            for (int i = 0; i < k; i++) {                                              \
                float c = hits[i];                                                     \
                float mean = total[i] / (c > 1.0f ? c : 1.0f);                        \
                float t = b[i] + (c == 1.0f ? scaled[i] : mean);                       \
                total[i] = t;                                                          \
                over |= !(fabsf(t) < OVER_##ONAME);                                    \
            }                                                                          \
            O *o = out + s;                                                            \
            for (int i = 0; i < k; i++) store_##ONAME(o, i, total[i]);                 \
        }                                                                              \
        return bad | (over << 1);                                                      \
    }

/* Ordered integer keys: adjacent floats of one dtype have keys one apart (+0 and -0 both 0). */
static inline int32_t key_f32(const float *p, int64_t i) {
    int32_t u;
    memcpy(&u, p + i, 4);
    return u < 0 ? -(u & 0x7fffffff) : u; /* the gap of two float32 keys can overflow only far from one step */
}
static inline int32_t key_bf16(const uint16_t *p, int64_t i) {
    int32_t u = p[i];
    return (u & 0x8000) ? -(u & 0x7fff) : u;
}
static inline int32_t key_f16(const _Float16 *p, int64_t i) {
    uint16_t v;
    memcpy(&v, p + i, 2);
    int32_t u = v;
    return (u & 0x8000) ? -(u & 0x7fff) : u;
}

/* The statistics pass with diagnostics: the counts of count_*, plus
 *   ints[4n]  per agent: active, unique, pair, single-step (changed by one step of T)
 *   ints[2P]  per pair i<j (row-major): entries both changed, of those with the same sign
 *   sums[2n]  per agent: sum |tau| over its unique entries, over its shared entries
 *   sums[3P]  per pair: sum tau_i tau_j, sum tau_i^2, sum tau_j^2 over the common entries
 * Products and sums in double (a product of two float32 deltas is exact in double). The
 * double sums run in LANES independent partial sums, added in a fixed order per block: the
 * loops vectorise without reassociation, and a result depends only on the block split. The
 * sums of each `span` entries (a multiple of BLOCK) go to a row of their own in `rows`, which
 * the caller adds in order: so the threads' split of a tensor (whole spans each) never changes them. */
#define LANES 8

/* LANES floats, and LANES doubles, as one GCC/clang vector each: a vector of partial sums adds
 * lane l to lane l, the same additions in the same order as a loop over l, in one instruction.
 * Written as a loop over l, gcc 12 assembled each vector from eight scalar loads. */
typedef float lanes_f __attribute__((vector_size(LANES * sizeof(float))));
typedef double lanes_d __attribute__((vector_size(LANES * sizeof(double))));

/* x[0..LANES) widened to double (exact). Static, so the ABI gcc warns about without AVX-512 is never used. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
/* one instruction: gcc 12 widens a whole vector in two halves, a shuffle each */
static inline lanes_d lanes_load(const float *x) { return (lanes_d)_mm512_cvtps_pd(_mm256_loadu_ps(x)); }
#else
static inline lanes_d lanes_load(const float *x) {
    lanes_f v;
    memcpy(&v, x, sizeof v);
    return __builtin_convertvector(v, lanes_d);
}
#endif

/* out += (sum of x[0..k), sum of y[0..k)) in double, LANES partial sums each, added in a fixed
 * order. Two sums in one loop: a partial sum waits on its own previous add, so one sum alone stalls. */
static void lanes_sum2(const float *x, const float *y, int k, double *out) {
    lanes_d ax = {0}, ay = {0};
    int i = 0;
    for (; i + LANES <= k; i += LANES) {
        ax += lanes_load(x + i);
        ay += lanes_load(y + i);
    }
    double px[LANES], py[LANES];
    memcpy(px, &ax, sizeof px);
    memcpy(py, &ay, sizeof py);
    for (; i < k; i++) {
        px[0] += (double)x[i];
        py[0] += (double)y[i];
    }
    double tx = 0.0, ty = 0.0;
    for (int l = 0; l < LANES; l++) {
        tx += px[l];
        ty += py[l];
    }
    out[0] += tx;
    out[1] += ty;
}

/* out += (sum x*y, sum x*x, sum y*y) in double (each product exact), LANES partial sums
 * added in a fixed order */
static void lanes_dot3(const float *x, const float *y, int k, double *out) {
    lanes_d xy = {0}, xx = {0}, yy = {0};
    int i = 0;
    for (; i + LANES <= k; i += LANES) {
        lanes_d u = lanes_load(x + i), v = lanes_load(y + i);
        xy += u * v;
        xx += u * u;
        yy += v * v;
    }
    double pxy[LANES], pxx[LANES], pyy[LANES];
    memcpy(pxy, &xy, sizeof pxy);
    memcpy(pxx, &xx, sizeof pxx);
    memcpy(pyy, &yy, sizeof pyy);
    for (; i < k; i++) {
        double u = x[i], v = y[i];
        pxy[0] += u * v;
        pxx[0] += u * u;
        pyy[0] += v * v;
    }
    for (int l = 0; l < LANES; l++) {
        out[0] += pxy[l];
        out[1] += pxx[l];
        out[2] += pyy[l];
    }
}

#define DEFINE_DIAGNOSE(NAME, T)                                                       \
    int diagnose_##NAME(const T *base, const T *const *agents, int n, float eps,       \
                        int64_t len, int64_t span, int64_t *ints, double *rows) {      \
        float b[BLOCK];                                                                \
        int32_t kb[BLOCK];                                                             \
        uint8_t hits[BLOCK];                                                           \
        float wa[BLOCK], wb[BLOCK];                                                    \
        uint8_t *mask = malloc(mask_bytes(n));                                         \
        float *delta = malloc(delta_bytes(n));                                         \
        int64_t *pint = ints + 4 * n;                                                  \
        int64_t width = 2 * n + 3 * ((int64_t)n * (n - 1) / 2);                        \
        int bad = 0;                                                                   \
        if (!mask || !delta) {                                                         \
            free(mask);                                                                \
            free(delta);                                                               \
            return NO_MEMORY;                                                          \
        }                                                                              \
        for (int64_t s = 0; s < len; s += BLOCK) {                                     \
            int k = (len - s) < BLOCK ? (int)(len - s) : BLOCK;                        \
            double *sums = rows + (s / span) * width; /* this span's row */           \
            double *psum = sums + 2 * n;                                               \
            for (int i = 0; i < k; i++) {                                              \
                b[i] = load_##NAME(base, s + i);                                       \
                kb[i] = key_##NAME(base, s + i);                                       \
                hits[i] = 0;                                                           \
            }                                                                          \
            for (int t = 0; t < n; t++) {                                              \
                const T *a = agents[t] + s;                                            \
                uint8_t *m = mask + (size_t)t * BLOCK;                                 \
                float *d = delta + (size_t)t * BLOCK;                                  \
                uint16_t single = 0;                                                   \
                for (int i = 0; i < k; i++) {                                          \
                    d[i] = load_##NAME(a, i) - b[i];                                   \
                    float ad = fabsf(d[i]);                                            \
                    bad |= !(ad <= FLT_MAX);                                           \
                    m[i] = ad > eps;                                                   \
                    hits[i] += m[i];                                                   \
                    int32_t gap = key_##NAME(a, i) - kb[i];                            \
                    single += m[i] & ((gap == 1) | (gap == -1));                       \
                }                                                                      \
                ints[4 * t + 3] += single;                                             \
            }                                                                          \
            for (int t = 0; t < n; t++) {                                              \
                const uint8_t *m = mask + (size_t)t * BLOCK;                           \
                const float *d = delta + (size_t)t * BLOCK;                            \
                uint16_t act = 0, uni = 0, pair = 0;                                   \
                for (int i = 0; i < k; i++) {                                          \
                    act += m[i];                                                       \
                    uni += m[i] & (hits[i] == 1);                                      \
                    pair += m[i] & (hits[i] == 2);                                     \
                    float ad = fabsf(d[i]);                                            \
                    wa[i] = (m[i] & (hits[i] == 1)) ? ad : 0.0f;                       \
                    wb[i] = (m[i] & (hits[i] >= 2)) ? ad : 0.0f;                       \
                }                                                                      \
                lanes_sum2(wa, wb, k, sums + 2 * t);                                   \
                ints[4 * t] += act;                                                    \
                ints[4 * t + 1] += uni;                                                \
                ints[4 * t + 2] += pair;                                               \
            }                                                                          \
            int p = 0;                                                                 \
            for (int x = 0; x < n; x++) {                                              \
                for (int y = x + 1; y < n; y++, p++) {                                 \
                    const uint8_t *mx = mask + (size_t)x * BLOCK;                      \
                    const uint8_t *my = mask + (size_t)y * BLOCK;                      \
                    const float *dx = delta + (size_t)x * BLOCK;                       \
                    const float *dy = delta + (size_t)y * BLOCK;                       \
                    uint16_t common = 0, same = 0;                                     \
                    for (int i = 0; i < k; i++) {                                      \
                        int both = mx[i] & my[i];                                      \
                        common += both;                                                \
                        same += both & ((dx[i] > 0.0f) == (dy[i] > 0.0f));             \
                        wa[i] = both ? dx[i] : 0.0f;                                   \
                        wb[i] = both ? dy[i] : 0.0f;                                   \
                    }                                                                  \
                    pint[2 * p] += common;                                             \
                    pint[2 * p + 1] += same;                                           \
                    lanes_dot3(wa, wb, k, psum + 3 * p);                               \
                }                                                                      \
            }                                                                          \
        }                                                                              \
        free(mask);                                                                    \
        free(delta);                                                                   \
        return bad;                                                                    \
    }

DEFINE_DIAGNOSE(f32, float)
DEFINE_DIAGNOSE(bf16, uint16_t)
DEFINE_DIAGNOSE(f16, _Float16)

DEFINE_COUNT(f32, float)
DEFINE_COUNT(bf16, uint16_t)
DEFINE_COUNT(f16, _Float16)

DEFINE_MERGE(f32, float, f32, float)
DEFINE_MERGE(f32, float, bf16, uint16_t)
DEFINE_MERGE(f32, float, f16, _Float16)
DEFINE_MERGE(bf16, uint16_t, f32, float)
DEFINE_MERGE(bf16, uint16_t, bf16, uint16_t)
DEFINE_MERGE(bf16, uint16_t, f16, _Float16)
DEFINE_MERGE(f16, _Float16, f32, float)
DEFINE_MERGE(f16, _Float16, bf16, uint16_t)
DEFINE_MERGE(f16, _Float16, f16, _Float16)
