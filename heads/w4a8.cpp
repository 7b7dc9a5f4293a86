// The w4a8 product (gorgon.heads.quantize.W4A8Linear): 4-bit weights on Q4_1's grid times 8-bit activations, each
// block of 32 inputs of a row with its own scale (llama.cpp's Q4_1 x Q8_1 arithmetic), summed in exact integers.
//
// Why a kernel of our own: torch's int4 kernel multiplies in float32 after unpacking, so on one core its cost grows
// with every row from two on, and a verify forward of a few nodes costs 1.6x one step; int8 products run four
// multiplications per instruction (AVX512-VNNI), so several rows cost little more than reading the weights once.
// No maintained library runs this on an x86 CPU from torch (torchao 0.18's CPU int4 layout is gone, torch's
// _dyn_quant_matmul_4bit is a reference loop off ARM), so this file does, in two paths that give the same bits:
// AVX512-VNNI where the compiler targets it, and a plain loop elsewhere (also what the tests compare against).
//
// Each output row's arithmetic reads only its own input row, in a fixed order over the blocks:
//     out[m, n] = sum over blocks b of  float(I[m, n, b]) * (scale[n, b] * dx[m, b])  +  minimum[n, b] * t[m, b]
// with I the exact integer sum of codes times quantized inputs, dx the input block's scale and t = dx * (sum of the
// block's quantized inputs); each term is a fused multiply-add onto the running sum. So a row's result does not
// depend on the rows beside it, which the speculative decoder's greedy exactness rests on.
//
// Weight layout (packed by W4A8Linear.pack): for each group of 16 output rows and each block of 32 inputs, 4 x 64
// bytes; byte 4c + r of part j holds the code of output row c at input 4j + r (low nibble) and 4(j + 4) + r (high).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define GORGON_VNNI 1
#else
#define GORGON_VNNI 0
#endif

namespace {

constexpr int64_t BLOCK = 32, GROUP = 16;

// Each row's inputs per block of 32: int8 codes, the block's scale dx = max|x| / 127 and t = dx * sum(codes).
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* codes, float* dx, float* t) {
  const int64_t blocks = K / BLOCK;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + m * K + b * BLOCK;
      float most = 0.f;
      for (int64_t k = 0; k < BLOCK; ++k) most = std::fmax(most, std::fabs(xb[k]));
      const float d = most / 127.f, inverse = most > 0.f ? 127.f / most : 0.f;
      int32_t sum = 0;
      for (int64_t k = 0; k < BLOCK; ++k) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(xb[k] * inverse));
        codes[m * K + b * BLOCK + k] = static_cast<int8_t>(q);
        sum += q;
      }
      dx[m * blocks + b] = d;
      t[m * blocks + b] = d * static_cast<float>(sum);
    }
  }
}

// The plain loop: one output at a time, the same operations in the same order as the vector path.
void product_plain(const int8_t* codes, const float* dx, const float* t, const uint8_t* packed, const at::Half* scales,
                   const at::Half* minimums, int64_t M, int64_t K, int64_t g0, int64_t g1, float* out, int64_t N) {
  const int64_t blocks = K / BLOCK;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t c = 0; c < GROUP; ++c) {
        float acc = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* w = packed + (g * blocks + b) * 4 * 64;
          const int8_t* xb = codes + m * K + b * BLOCK;
          int32_t sum = 0;
          for (int64_t j = 0; j < 4; ++j) {
            for (int64_t r = 0; r < 4; ++r) {
              const uint8_t byte = w[j * 64 + 4 * c + r];
              sum += static_cast<int32_t>(byte & 15) * xb[4 * j + r] + static_cast<int32_t>(byte >> 4) * xb[4 * (j + 4) + r];
            }
          }
          const int64_t s = (g * blocks + b) * GROUP + c;
          const float scale = static_cast<float>(scales[s]) * dx[m * blocks + b];
          acc = std::fma(static_cast<float>(sum), scale, acc);
          acc = std::fma(static_cast<float>(minimums[s]), t[m * blocks + b], acc);
        }
        out[m * N + g * GROUP + c] = acc;
      }
    }
  }
}

#if GORGON_VNNI
// ROWS input rows at once against one group of 16 outputs: each weight byte is read and unpacked once for them all.
template <int ROWS>
void group_rows(const int8_t* codes, const float* dx, const float* t, const uint8_t* packed, const at::Half* scales,
                const at::Half* minimums, int64_t m0, int64_t K, int64_t g, float* out, int64_t N) {
  const int64_t blocks = K / BLOCK;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[ROWS];
  for (int i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = packed + (g * blocks + b) * 4 * 64;
    __m512i sum[ROWS];
    for (int i = 0; i < ROWS; ++i) sum[i] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i both = _mm512_loadu_si512(w + j * 64);
      const __m512i first = _mm512_and_si512(both, low);
      const __m512i second = _mm512_and_si512(_mm512_srli_epi16(both, 4), low);
      for (int i = 0; i < ROWS; ++i) {
        int32_t a, c;
        const int8_t* xb = codes + (m0 + i) * K + b * BLOCK;
        std::memcpy(&a, xb + 4 * j, 4);
        std::memcpy(&c, xb + 4 * (j + 4), 4);
        sum[i] = _mm512_dpbusd_epi32(sum[i], first, _mm512_set1_epi32(a));
        sum[i] = _mm512_dpbusd_epi32(sum[i], second, _mm512_set1_epi32(c));
      }
    }
    const int64_t s = (g * blocks + b) * GROUP;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + s)));
    const __m512 minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimums + s)));
    for (int i = 0; i < ROWS; ++i) {
      const int64_t at = (m0 + i) * blocks + b;
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[i]), _mm512_mul_ps(scale, _mm512_set1_ps(dx[at])), acc[i]);
      acc[i] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(t[at]), acc[i]);
    }
  }
  for (int i = 0; i < ROWS; ++i) _mm512_storeu_ps(out + (m0 + i) * N + g * GROUP, acc[i]);
}

void product_vnni(const int8_t* codes, const float* dx, const float* t, const uint8_t* packed, const at::Half* scales,
                  const at::Half* minimums, int64_t M, int64_t K, int64_t g0, int64_t g1, float* out, int64_t N) {
  constexpr int TILE = 8;
  for (int64_t g = g0; g < g1; ++g) {
    int64_t m0 = 0;
    for (; m0 + TILE <= M; m0 += TILE) group_rows<TILE>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N);
    switch (M - m0) {
      case 7: group_rows<7>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N); break;
      case 6: group_rows<6>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N); break;
      case 5: group_rows<5>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N); break;
      case 4: group_rows<4>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N); break;
      case 3: group_rows<3>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N); break;
      case 2: group_rows<2>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N); break;
      case 1: group_rows<1>(codes, dx, t, packed, scales, minimums, m0, K, g, out, N); break;
      default: break;
    }
  }
}
#endif

}  // namespace

// x (M, K) float32 times the packed weight: (M, N) float32. `plain` forces the plain loop (the tests compare).
torch::Tensor w4a8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor minimums,
                          bool plain) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "w4a8: x must be (M, K) float32");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 4, "w4a8: packed must be (N/16, K/32, 4, 64) uint8");
  const int64_t M = x.size(0), K = x.size(1), groups = packed.size(0), N = groups * GROUP, blocks = K / BLOCK;
  TORCH_CHECK(K % BLOCK == 0 && packed.size(1) == blocks, "w4a8: x has ", K, " inputs, the weight ", packed.size(1) * BLOCK);
  x = x.contiguous();
  auto codes = torch::empty({M, K}, torch::kInt8);
  auto dx = torch::empty({M, blocks}, torch::kFloat32), t = torch::empty({M, blocks}, torch::kFloat32);
  quantize_rows(x.data_ptr<float>(), M, K, codes.data_ptr<int8_t>(), dx.data_ptr<float>(), t.data_ptr<float>());
  auto out = torch::empty({M, N}, torch::kFloat32);
  const int8_t* c = codes.data_ptr<int8_t>();
  const float *d = dx.data_ptr<float>(), *s = t.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half *scale = scales.data_ptr<at::Half>(), *minimum = minimums.data_ptr<at::Half>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
#if GORGON_VNNI
    if (!plain) return product_vnni(c, d, s, w, scale, minimum, M, K, g0, g1, o, N);
#endif
    product_plain(c, d, s, w, scale, minimum, M, K, g0, g1, o, N);
  });
  return out;
}

bool w4a8_vector_path() { return GORGON_VNNI; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a8_linear", &w4a8_linear, "x (M, K) float32 times a packed w4a8 weight");
  m.def("w4a8_vector_path", &w4a8_vector_path, "whether the AVX512-VNNI path was compiled");
}
