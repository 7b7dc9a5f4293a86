// A quantized target's attention, one query row at a time (gorgon.decode.attention.quantized_attention).
//
// Why: on a quantized target, greedy speculation equals the target's own `generate` only if every verified node's
// attention is computed exactly as a one-token step computes it (a quantized layer's rounding of its input turns a
// last-bit difference into a larger one). torch's SDPA rounds a row apart when other rows share its call, so
// verification called it once per node and layer over that node's keys: about 50 us a call on this CPU, and a
// gathered copy of the keys for every node that is not on the tree's first path. Here each row's arithmetic reads
// only its own query and the keys it may see, in their order, so a row computes the same bits alone (a decoding
// step) or beside others (a verified tree), and one call takes every row: 20 us a row on 256 keys.
//
// For each row r, query head h (key/value head h / groups) and its n keys at positions p_0 < ... < p_{n-1}:
//     s_j = scale * (q . k_{p_j});  w_j = exp(s_j - max s);  out = (sum_j w_j v_{p_j}) / (sum_j w_j)
// with the sums taken in one fixed order. AVX-512 where the compiler targets it, a plain loop elsewhere (each is
// consistent with itself; they need not give the same bits as each other, nor as torch's SDPA).

#include <torch/extension.h>

#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define GORGON_AVX512 1
#else
#define GORGON_AVX512 0
#endif

namespace {

#if GORGON_AVX512
// exp(x) for x <= 0 (a softmax's shifted scores): 2^k * e^r with k = round(x / ln 2), |r| <= ln 2 / 2, and a
// degree-6 polynomial for e^r (Cephes' coefficients); below -87.3 the result is 0 or denormal, as expf's.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, k);
}

// One row and query head, D a multiple of 16 (at most 256): its output in `out`, `scores` holding n floats.
void head_row(const float* q, const float* k, const float* v, const int64_t* positions, int64_t n, int64_t D,
              float scale, float* scores, float* out) {
  const int64_t chunks = D / 16;
  __m512 query[16];
  for (int64_t c = 0; c < chunks; ++c) query[c] = _mm512_loadu_ps(q + 16 * c);
  float most = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* key = k + (positions ? positions[j] : j) * D;
    __m512 dot = _mm512_mul_ps(query[0], _mm512_loadu_ps(key));
    for (int64_t c = 1; c < chunks; ++c) dot = _mm512_fmadd_ps(query[c], _mm512_loadu_ps(key + 16 * c), dot);
    scores[j] = _mm512_reduce_add_ps(dot) * scale;
    most = std::fmax(most, scores[j]);
  }
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(most);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + j), shift));
    _mm512_mask_storeu_ps(scores + j, lanes, w);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, w));
  }
  __m512 acc[16];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* value = v + (positions ? positions[j] : j) * D;
    const __m512 w = _mm512_set1_ps(scores[j]);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16 * c), acc[c]);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], inverse));
}
#endif

void head_row_plain(const float* q, const float* k, const float* v, const int64_t* positions, int64_t n, int64_t D,
                    float scale, float* scores, float* out) {
  float most = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* key = k + (positions ? positions[j] : j) * D;
    float dot = 0.f;
    for (int64_t d = 0; d < D; ++d) dot = std::fma(q[d], key[d], dot);
    scores[j] = dot * scale;
    most = std::fmax(most, scores[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - most);
    total += scores[j];
  }
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float* value = v + (positions ? positions[j] : j) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = std::fma(scores[j], value[d], out[d]);
  }
  const float inverse = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] *= inverse;
}

}  // namespace

// query (rows, H, D), key and value (Hkv, T, D), float32; row r attends to its first counts[r] keys, or, where
// `positions` (rows, most) is given, to the keys at positions[r, :counts[r]]. Returns (rows, H, D).
torch::Tensor row_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value, std::vector<int64_t> counts,
                            c10::optional<torch::Tensor> positions, double scale) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key.scalar_type() == torch::kFloat32 &&
              value.scalar_type() == torch::kFloat32, "row_attention: float32 only");
  query = query.contiguous(), key = key.contiguous(), value = value.contiguous();
  const int64_t rows = query.size(0), H = query.size(1), D = query.size(2), kv_heads = key.size(0), T = key.size(1);
  TORCH_CHECK(H % kv_heads == 0 && key.size(2) == D && value.sizes() == key.sizes(), "row_attention: shapes differ");
  const int64_t groups = H / kv_heads;
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == rows, "row_attention: one count a row");
  const int64_t* count = counts.data();
  torch::Tensor where;
  if (positions.has_value()) where = positions->to(torch::kInt64).contiguous();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(count[r] >= 1 && count[r] <= T, "row_attention: a row sees no keys");
  auto out = torch::empty({rows, H, D}, torch::kFloat32);
  std::vector<float> scores(T);
  const float *q = query.data_ptr<float>(), *k = key.data_ptr<float>(), *v = value.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t* p = where.defined() ? where.data_ptr<int64_t>() + r * where.size(1) : nullptr;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / groups;
      const float *qh = q + (r * H + h) * D, *kg = k + g * T * D, *vg = v + g * T * D;
      float* oh = o + (r * H + h) * D;
#if GORGON_AVX512
      if (D % 16 == 0 && D <= 256) {
        head_row(qh, kg, vg, p, count[r], D, static_cast<float>(scale), scores.data(), oh);
        continue;
      }
#endif
      head_row_plain(qh, kg, vg, p, count[r], D, static_cast<float>(scale), scores.data(), oh);
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("row_attention", &row_attention, "each query row's attention over its own keys, alone");
}
