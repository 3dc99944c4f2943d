// Times the 8-bit kernel's encoders on one core, in cache: the portable loop (what the
// compiler makes of it with this build's tuning), the AVX-512 one (an explicit gather) and
// the AVX-512 VBMI one (byte permutes of the kernel's smaller table), side by side in one
// run, and checks that they give the same codes. Built and run
// by benchmarks/encoder_speed.py, which passes the encoder tables of
// optax_decoupled.cpu_kernel.encoder_table as files. It includes the kernel's source, so it
// times exactly the functions the kernel calls.
#include "../optax_decoupled/csrc/requantize_cpu.cc"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>

namespace {

std::vector<int32_t> Load(const char* path) {
  std::ifstream f(path, std::ios::binary);
  std::vector<int32_t> v;
  int32_t x;
  while (f.read(reinterpret_cast<char*>(&x), 4)) v.push_back(x);
  return v;
}

#if defined(OD_X86_AVX512)
// EncodeBlockVbmi with its table (built by the kernel's own BuildByteTable), as an EncodeFn.
const ByteTable* g_byte_table = nullptr;

void EncodeVbmi(const float* x, float factor, float scale, float lo, const int32_t* entries,
                int32_t shift, int32_t first, int32_t n, int block, uint8_t* codes) {
  EncodeBlockVbmi(*g_byte_table, x, factor, scale, lo, entries, shift, first, n, block, codes);
}
#endif

}  // namespace

// argv: table file, "signed" or "unsigned", repeats. Prints one JSON line.
int main(int argc, char** argv) {
  if (argc < 4) return 2;
  const std::vector<int32_t> t = Load(argv[1]);
  const bool is_signed = std::string(argv[2]) == "signed";
  const int repeats = std::stoi(argv[3]);
  const int n = 1 << 16, block = 256;  // 256 KiB of inputs: in L2
  std::vector<float> x(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (float& v : x) {
    v = normal(rng) * 1e-3f;  // gradient-like; squared for the unsigned map (a second moment)
    if (!is_signed) v = v * v;
  }
  std::vector<float> scale(n / block);
  for (int b = 0; b < n / block; ++b) scale[b] = FloatOf(AbsMaxBits(x.data() + b * block, block));
  const int32_t* entries = t.data() + kHeader;
  const float lo = t[3] ? -1.0f : 0.0f;
  std::vector<std::pair<const char*, EncodeFn>> encoders = {{"portable", EncodeBlock}};
#if defined(OD_X86_AVX512)
  if (CpuHasAvx2()) encoders.emplace_back("avx2", EncodeBlockAvx2);
  if (CpuHasAvx512()) encoders.emplace_back("avx512", EncodeBlockAvx512);
  const Encoder enc{nullptr, entries, t[0], t[1], t[2], lo};
  g_byte_table = CachedByteTable(enc);
  if (CpuHasAvx512Vbmi() && g_byte_table->ok) encoders.emplace_back("vbmi", EncodeVbmi);
#endif
  const size_t count = encoders.size();
  std::vector<std::vector<uint8_t>> codes(count, std::vector<uint8_t>(n));
  std::vector<double> best(count, 1e30);
  for (int r = 0; r < repeats; ++r) {
    for (size_t e = 0; e < count; ++e) {  // in turns, so that a slower moment hits both alike
      const auto t0 = std::chrono::steady_clock::now();
      for (int b = 0; b < n / block; ++b) {
        encoders[e].second(x.data() + b * block, 1.0f, scale[b], lo, entries, t[0], t[1], t[2],
                           block, codes[e].data() + b * block);
      }
      const auto t1 = std::chrono::steady_clock::now();
      best[e] = std::min(best[e], std::chrono::duration<double>(t1 - t0).count());
    }
  }
  std::printf("{\"map\": \"%s\", \"elements\": %d", argv[2], n);
  for (size_t e = 0; e < count; ++e) {
    std::printf(", \"%s_ns\": %.4f", encoders[e].first, best[e] * 1e9 / n);
  }
  bool same = true;
  for (size_t e = 1; e < count; ++e) same = same && codes[e] == codes[0];
  std::printf(", \"same_codes\": %s}\n", same ? "true" : "false");
  return 0;
}
