// Times the 8-bit kernel's per-block work for AdamW (Adam's two moments and its output) on one
// core, in cache, as RequantizeEmaImpl's AVX-512 VBMI, AVX-512F or AVX2 path runs it for each
// block of 256: decode and update mu and nu, compute the output, encode both. Two ways, side
// by side in one run, in turns: the output as a pass of its own (AdamOutBlock, after both
// moments' passes: the VBMI and AVX2 paths' way before the nineteenth session, and still the
// portable path's) and inside the moments' passes (AdamPart: nu's pass stores the
// denominator, mu's pass, run after it, the output). On the AVX-512F path the first way is
// that path's code before the twenty-first session: the moments' passes without the block
// max (AbsMaxBits, a pass of its own) and the output in a pass of its own. Checks that both
// ways give the same codes, scales and output, bit for bit. Built and run by benchmarks/kernel_pipeline.py, which passes the maps
// and the encoder tables (optax_decoupled.quantization.dynamic_map,
// optax_decoupled.cpu_kernel.encoder_table) as files. It includes the kernel's source, so it
// times exactly the functions the kernel calls.
#include "../optax_decoupled/csrc/requantize_cpu.cc"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>

namespace {

template <typename T>
std::vector<T> Load(const char* path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<T> v;
  T x;
  while (f.read(reinterpret_cast<char*>(&x), sizeof(T))) v.push_back(x);
  return v;
}

#if defined(OD_X86_AVX512)
struct Moment {  // one moment's stored state and what encodes it
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
};

struct Run {  // one way's state, updated in place pass after pass
  Moment mu, nu;
  std::vector<float> out;
};
#endif

}  // namespace

// argv: signed table, unsigned table, signed map, unsigned map (files), repeats, path ("vbmi",
// "avx512f" or "avx2"). Prints one JSON line.
int main(int argc, char** argv) {
  if (argc < 7) return 2;
  const std::string path = argv[6];
  if (path != "vbmi" && path != "avx512f" && path != "avx2") return 2;
#if defined(OD_X86_AVX512)
  const bool vbmi = path == "vbmi", avx512 = path == "avx512f";
  if (vbmi ? !CpuHasAvx512Vbmi() : avx512 ? !CpuHasAvx512() : !CpuHasAvx2()) {
    std::printf("{\"path\": \"%s\", \"available\": false}\n", path.c_str());
    return 0;
  }
  const int repeats = std::stoi(argv[5]);
  // 128 KiB of gradient: with both ways' moments and outputs, 512 KiB, in L2.
  const int n = 1 << 15, block = 256, n_blocks = n / block;
  std::vector<int32_t> tables[2] = {Load<int32_t>(argv[1]), Load<int32_t>(argv[2])};
  std::vector<float> maps[2] = {Load<float>(argv[3]), Load<float>(argv[4])};
  Encoder enc[2];
  const ByteTable* byte_tables[2];
  MapPlanes planes[2];
  for (int k = 0; k < 2; ++k) {  // 0: mu (signed map), 1: nu (unsigned)
    const std::vector<int32_t>& t = tables[k];
    enc[k] = Encoder{maps[k].data(), t.data() + kHeader, t[0], t[1], t[2], t[3] ? -1.0f : 0.0f};
    byte_tables[k] = vbmi ? CachedByteTable(enc[k]) : nullptr;  // the others': none
    planes[k] = PlanesOf(maps[k].data());
    if (vbmi && !byte_tables[k]->ok) return 3;
  }
  // Gradient-like inputs; the moments start as the quantized moments of other such draws.
  std::vector<float> g(n), mu0(n), nu0(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (int i = 0; i < n; ++i) {
    g[i] = normal(rng) * 1e-3f;
    mu0[i] = normal(rng) * 1e-3f;
    nu0[i] = mu0[i] * mu0[i];
  }
  Run start;
  start.out.resize(n);
  for (Moment* m : {&start.mu, &start.nu}) {
    m->codes.resize(n);
    m->absmax.resize(n_blocks);
  }
  // The encoder each path takes (RequantizeEmaImpl: the VBMI one where byte_tables are set).
  const EncodeFn encode = vbmi || avx512 ? EncodeBlockAvx512 : EncodeBlockAvx2;
  for (int b = 0; b < n_blocks; ++b) {
    const int off = b * block;
    QuantizeBlock(mu0.data() + off, enc[0], block, start.mu.codes.data() + off,
                  &start.mu.absmax[b], AbsMaxBits(mu0.data() + off, block), encode,
                  byte_tables[0]);
    QuantizeBlock(nu0.data() + off, enc[1], block, start.nu.codes.data() + off,
                  &start.nu.absmax[b], AbsMaxBits(nu0.data() + off, block), encode,
                  byte_tables[1]);
  }
  // Step 3 of AdamW's defaults: b1 = 0.9, b2 = 0.999, eps = 1e-8.
  const AdamCoefficients adam{1, 1.0f / 0.271f, 1, 1.0f / 0.002997f, 1e-8f, 0.0f};
  const float c_in[2] = {0.1f, 0.001f}, c_keep[2] = {0.9f, 0.999f};
  const int powers[2] = {1, 2};
  const char* names[2] = {"separate", "in_passes"};
  Run runs[2] = {start, start};
  double best[2] = {1e30, 1e30};
  std::vector<float> values(3 * block);  // mu's, nu's, the output's denominators
  for (int r = 0; r < repeats; ++r) {
    for (int way = 0; way < 2; ++way) {  // in turns, so that a slower moment hits both alike
      Run& run = runs[way];
      Moment* moments[2] = {&run.mu, &run.nu};
      ScopedFlushDenormals flush;
      const auto t0 = std::chrono::steady_clock::now();
      for (int b = 0; b < n_blocks; ++b) {
        const int off = b * block;
        uint32_t top[2];
        auto pass = [&](int k, AdamPart::Role role) {
          const AdamPart part{role, adam, values.data() + 2 * block, run.out.data() + off};
          const uint8_t* codes = moments[k]->codes.data() + off;
          float* out = values.data() + k * block;
          const float a = moments[k]->absmax[b];
          if (avx512 && way == 0) {  // the AVX-512F path before: the block max a pass of its own
            EmaBlockAvx512(g.data() + off, codes, maps[k].data(), a, c_in[k], c_keep[k],
                           powers[k], block, block, out);
            top[k] = AbsMaxBits(out, block);
            return;
          }
          top[k] = vbmi     ? EmaBlockVbmi(g.data() + off, codes, maps[k].data(), planes[k], a,
                                           c_in[k], c_keep[k], powers[k], block, block, out,
                                           nullptr, part)
                   : avx512 ? EmaBlockAvx512Pass(g.data() + off, codes, maps[k].data(), a,
                                                 c_in[k], c_keep[k], powers[k], block, block,
                                                 out, nullptr, part)
                            : EmaBlockAvx2(g.data() + off, codes, maps[k].data(), a, c_in[k],
                                           c_keep[k], powers[k], block, block, out, nullptr,
                                           part);
        };
        if (way == 0) {
          pass(0, AdamPart::kNone);
          pass(1, AdamPart::kNone);
          AdamOutBlock(values.data(), values.data() + block, adam.scale_num, adam.inv_bc1,
                       adam.scale_den, adam.inv_bc2, adam.eps, adam.eps_root, block,
                       run.out.data() + off);
        } else {
          pass(1, AdamPart::kDenominator);
          pass(0, AdamPart::kQuotient);
        }
        for (int k = 0; k < 2; ++k) {
          QuantizeBlock(values.data() + k * block, enc[k], block,
                        moments[k]->codes.data() + off, &moments[k]->absmax[b], top[k],
                        encode, byte_tables[k]);
        }
      }
      const auto t1 = std::chrono::steady_clock::now();
      best[way] = std::min(best[way], std::chrono::duration<double>(t1 - t0).count());
    }
  }
  const bool same = runs[0].mu.codes == runs[1].mu.codes &&
                    runs[0].mu.absmax == runs[1].mu.absmax &&
                    runs[0].nu.codes == runs[1].nu.codes &&
                    runs[0].nu.absmax == runs[1].nu.absmax && runs[0].out == runs[1].out;
  std::printf("{\"path\": \"%s\", \"available\": true, \"elements\": %d, \"block\": %d, "
              "\"steps\": %d",
              path.c_str(), n, block, repeats);
  for (int way = 0; way < 2; ++way) {
    std::printf(", \"%s_ns\": %.4f", names[way], best[way] * 1e9 / n);
  }
  std::printf(", \"same_results\": %s}\n", same ? "true" : "false");
#else
  std::printf("{\"path\": \"%s\", \"available\": false}\n", path.c_str());
#endif
  return 0;
}
