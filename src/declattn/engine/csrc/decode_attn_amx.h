// Decode attention for bf16 queries over a bf16 pool with AMX (Intel since Sapphire
// Rapids): included by decode_attn.cpp, inside its namespace, after decode_attn_avx512.h
// (whose exp16 and transpose it uses).
//
// Why: on the AVX-512 path a tile of 32 rows of one KV head with 7 query heads costs ~900
// fp32 FMAs to score and ~900 more to weight the values, and on Sapphire Rapids-class
// Xeons that arithmetic, not the bytes, bounds a long layer with the rows in cache. An AMX tile multiply does a 16 x 16 x 32 bf16
// product in one instruction, so both products become eight of them per 32 rows and what
// is left is moving data into the shapes they take:
// - scores: S^T [16 rows x 16 heads] = K [16 rows x 32 dims] . Q^T, per 32 dims. K is
//   the A operand as the pool holds it (rows ``dim`` apart), Q^T is laid out once per
//   work item; S^T is then transposed (16 x 16 floats) to one row of scores per head;
// - values: O [heads x 16 dims] += P [heads x 32 rows] . V [32 rows x 16 dims]: P is the
//   softmax's weights rounded to bf16, V is laid out as AMX wants it (each pair of rows
//   interleaved, two shuffles per 64 bytes).
// The rows go in chunks of up to kChunk: every score of a chunk, then its softmax, then
// every product with its values, accumulated in tiles across the chunk (one softmax
// rescale and one store of the products per chunk, not per 32 rows); tile by tile, a
// focus view's short runs paid that rescale and store far more often.
//
// Exactness: the scores are exact bf16 x bf16 products summed in fp32 (as on the other
// paths); the weights are rounded to bf16 before they meet the values (the other paths
// keep them fp32), a relative error of at most 2^-9 per weight while their sum ``l``
// stays fp32: within the bf16 output's own rounding (tests/engine/test_native.py).
//
// Linux hands out AMX only on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), once per
// process; where that is refused the kernel keeps the AVX-512 path.

#include <sys/syscall.h>
#include <memory>
#include <unistd.h>

// Whether this process may use AMX tiles: asked once.
inline bool amx_usable() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Every tile 16 rows of 64 bytes. By number (GCC's tile intrinsics take literal numbers
// only): scores 0 and 3 S^T, 1 and 4 K tiles, 2 a Q^T tile; values 3 P, 4 a V tile, and
// the O tiles of 64 dims 0, 1, 2, 5 (the scores' tiles are free by then).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

constexpr int kChunk = 512;  // rows scored, softmaxed and accumulated together

// Where column n of V tile 2c (h = 0) or 2c + 1 (h = 1) comes from: ``unpacklo/hi_epi16``
// pair rows within 128-bit lanes, so tile 2c + h holds dims 32c + 8L + 4h + k, n = 4L + k.
inline int v_tile_dim(int c, int h, int n) { return 32 * c + 8 * (n / 4) + 4 * h + n % 4; }

// A thread's buffers for its work items (a chunk's scores by row and by head, its weights
// in bf16, V tiles, the rows' addresses, the output in the tiles' order): ~140 KB, so on
// the heap, zeroed once per thread. Nothing in it is allocated or cleared per work item,
// which a DA step's many short items would each pay: the rows of P and the columns of Q^T
// past ``group`` may hold an earlier item's values, and a tile multiply takes each row of
// its output from the same row of its first operand and column of its second, so those
// reach only the outputs of heads past ``group``, which are never read.
struct AmxScratch {
  alignas(64) uint32_t qt[8][16][16];         // Q^T per 32 dims: [pair of dims][head]
  alignas(64) float st[kChunk][16];           // S^T
  alignas(64) float s[16][kChunk];            // scores by head, then exp(s - m)
  alignas(64) uint16_t pb[16][kChunk];        // the exps in bf16
  alignas(64) uint32_t vt[2][4][16][16];      // V tiles of 32 rows x 64 dims, two sets
  alignas(64) float ob[4][16][16];            // O tiles of 64 dims
  alignas(64) at::BFloat16 gathered[2][16 * 256];  // 16 K rows that are not one run
  alignas(64) float permuted[16 * 256];       // acc in the tiles' column order
  const at::BFloat16* krows[kChunk];
  const at::BFloat16* vrows[kChunk];
};

// The first K row of 16 rows for a tile load: their own if they are one run (``dim``
// apart), else a copy of them in ``gathered``.
inline const at::BFloat16* k_tile_rows(const at::BFloat16* const* kr, int dim, bool whole,
                                      at::BFloat16* gathered) {
  bool one_run = whole;
  for (int t = 1; t < 16 && one_run; ++t) one_run = kr[t] == kr[0] + t * dim;
  if (one_run) return kr[0];
  for (int t = 0; t < 16; ++t) std::memcpy(gathered + t * dim, kr[t], dim * 2);
  return gathered;
}

// S^T of ``n`` rows (padded to whole 32-row tiles with a tile's first row) into sc.st, 32
// rows at a time into two accumulators (tiles 0 and 3) from two K tiles (1 and 4): tile
// registers are not renamed, so one accumulator's multiply, store and zeroing would
// otherwise wait on each other (scores took half of a layer hot in cache that way).
template <int C>
void amx_scores(const at::BFloat16* const* krows, int n, AmxScratch& sc) {
  constexpr int dim = 32 * C;
  for (int t0 = 0; t0 < n; t0 += 32) {
    const at::BFloat16* a = k_tile_rows(krows + t0, dim, t0 + 16 <= n, sc.gathered[0]);
    const at::BFloat16* b = k_tile_rows(krows + t0 + 16, dim, t0 + 32 <= n, sc.gathered[1]);
    _tile_zero(0);
    _tile_zero(3);
    for (int c = 0; c < C; ++c) {
      _tile_loadd(2, sc.qt[c], 64);
      _tile_loadd(1, a + 32 * c, dim * 2);
      _tile_loadd(4, b + 32 * c, dim * 2);
      _tile_dpbf16ps(0, 1, 2);
      _tile_dpbf16ps(3, 4, 2);
    }
    _tile_stored(0, sc.st[t0], 64);
    _tile_stored(3, sc.st[t0 + 16], 64);
  }
}

// The chunk's scores by head (scaled), their online softmax against m and l (acc
// rescaled where the maximum grows), the weights in bf16 in sc.pb (0 past n).
inline void amx_softmax(int n, int group, float scale, int dim, float* acc, float* m,
                        float* l, AmxScratch& sc) {
  const int padded = (n + 15) / 16 * 16;
  for (int t0 = 0; t0 < padded; t0 += 16) {
    const at::BFloat16* rows[16];
    for (int t = 0; t < 16; ++t) rows[t] = reinterpret_cast<const at::BFloat16*>(sc.st[t0 + t]);
    __m512i byhead[16];
    transpose_rows<1>(rows, byhead);  // lane t of byhead[g]: head g's score of row t0 + t
    for (int g = 0; g < group; ++g)
      _mm512_store_ps(sc.s[g] + t0, _mm512_mul_ps(_mm512_castsi512_ps(byhead[g]), _mm512_set1_ps(scale)));
  }
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int g = 0; g < group; ++g) {
    float* sg = sc.s[g];
    __m512 mx = ninf;
    for (int t0 = 0; t0 < padded; t0 += 16) {
      const __mmask16 k = n - t0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - t0)) - 1);
      mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(ninf, k, sg + t0));
    }
    const float mnew = std::max(m[g], _mm512_reduce_max_ps(mx));
    if (mnew > m[g]) {
      const float c = std::exp(m[g] - mnew);  // exp(-inf) = 0 on the first chunk
      l[g] *= c;
      for (int d = 0; d < dim; ++d) acc[g * dim + d] *= c;
      m[g] = mnew;
    }
    const __m512 mv = _mm512_set1_ps(mnew);
    __m512 sum = _mm512_setzero_ps();
    for (int t0 = 0; t0 < kChunk; t0 += 32) {
      __m512 e[2];
      for (int h = 0; h < 2; ++h) {
        const int t = t0 + 16 * h;
        const __mmask16 k = n - t >= 16 ? 0xFFFF : n <= t ? 0 : static_cast<__mmask16>((1u << (n - t)) - 1);
        e[h] = k ? _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_load_ps(sg + t), mv)))
                 : _mm512_setzero_ps();
        sum = _mm512_add_ps(sum, e[h]);
      }
      _mm512_store_si512(sc.pb[g] + t0, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
      if (t0 + 32 >= n) break;
    }
    l[g] += _mm512_reduce_add_ps(sum);
  }
}

// V tiles of 32 rows and the 64 dims from d0 (two per 32 dims, ``v_tile_dim``).
inline void amx_v_tiles(const at::BFloat16* const* vrows, int d0, int chunks,
                        uint32_t (*vt)[16][16]) {
  for (int i = 0; i < 16; ++i)
    for (int c = 0; c < chunks; ++c) {
      const __m512i a = _mm512_loadu_si512(vrows[2 * i] + d0 + 32 * c);
      const __m512i b = _mm512_loadu_si512(vrows[2 * i + 1] + d0 + 32 * c);
      _mm512_store_si512(vt[2 * c][i], _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(vt[2 * c + 1][i], _mm512_unpackhi_epi16(a, b));
    }
}

// acc (tiles' column order) += P . V over the chunk's n rows, 64 dims at a time.
template <int C>
void amx_values(const at::BFloat16* const* vrows, int n, int group, float* acc, AmxScratch& sc) {
  constexpr int dim = 32 * C, chunks = C < 2 ? C : 2;  // 32-dim chunks per 64 dims
  for (int d0 = 0; d0 < dim; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(5);
    for (int t0 = 0, set = 0; t0 < n; t0 += kTile, set ^= 1) {
      uint32_t(*vt)[16][16] = sc.vt[set];
      amx_v_tiles(vrows + t0, d0, chunks, vt);
      _tile_loadd(3, sc.pb[0] + t0, 2 * kChunk);
      _tile_loadd(4, vt[0], 64);
      _tile_dpbf16ps(0, 3, 4);
      _tile_loadd(4, vt[1], 64);
      _tile_dpbf16ps(1, 3, 4);
      if constexpr (chunks == 2) {
        _tile_loadd(4, vt[2], 64);
        _tile_dpbf16ps(2, 3, 4);
        _tile_loadd(4, vt[3], 64);
        _tile_dpbf16ps(5, 3, 4);
      }
    }
    _tile_stored(0, sc.ob[0], 64);
    _tile_stored(1, sc.ob[1], 64);
    _tile_stored(2, sc.ob[2], 64);
    _tile_stored(5, sc.ob[3], 64);
    for (int g = 0; g < group; ++g)
      for (int j = 0; j < 2 * chunks; ++j) {
        float* a = acc + g * dim + d0 + 16 * j;
        _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_load_ps(sc.ob[j][g])));
      }
  }
}

// attend_rows for bf16 q (``qb``, unscaled, as bf16 pairs) over bf16 pools, dim 32 C,
// by AMX: the same work item and outputs (acc, m, l) as attend_rows_bf16.
template <int C>
void attend_rows_amx(const uint32_t* qb, float scale, int group, const at::BFloat16* kbase,
                     const at::BFloat16* vbase, const int64_t* runs, const int64_t* ends,
                     int64_t n_runs, int64_t lo, int64_t hi, float* acc, float* m, float* l) {
  static_assert(kTile == 32 && kChunk % kTile == 0, "a tile is two AMX row tiles, and P's K");
  constexpr int dim = 32 * C;
  static thread_local std::unique_ptr<AmxScratch> mine(new AmxScratch());
  AmxScratch* sc = mine.get();
  float* permuted = sc->permuted;
  std::fill(permuted, permuted + group * dim, 0.0f);
  std::fill(m, m + group, -std::numeric_limits<float>::infinity());
  std::fill(l, l + group, 0.0f);
  for (int n = 0; n < group; ++n)
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < 16; ++i) sc->qt[c][i][n] = qb[n * 16 * C + 16 * c + i];
  configure_tiles();
  RowWalk<at::BFloat16> walk(runs, ends, n_runs, lo);
  for (int64_t at = lo; at < hi;) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, hi - at));
    for (int t0 = 0; t0 < n; t0 += kTile) {
      const int k = std::min(kTile, n - t0);
      walk.tile(k, dim, kbase, vbase, sc->krows + t0, sc->vrows + t0);
      for (int t = t0 + k; t < t0 + kTile; ++t) sc->vrows[t] = sc->vrows[t0];  // weighted by 0
    }
    at += n;
    amx_scores<C>(sc->krows, n, *sc);
    amx_softmax(n, group, scale, dim, permuted, m, l, *sc);
    amx_values<C>(sc->vrows, n, group, permuted, *sc);
  }
  _tile_release();
  for (int g = 0; g < group; ++g)
    for (int j = 0; j < 2 * C; ++j)
      for (int n = 0; n < 16; ++n)
        acc[g * dim + v_tile_dim(j / 2, j % 2, n)] = permuted[g * dim + 16 * j + n];
}
