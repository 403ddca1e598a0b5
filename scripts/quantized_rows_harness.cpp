// The quantized-rows kernel alone, outside MLX: products of 1, 2, 4, 8, 16 and 32 rows against
// 100 different matrices in turn (so that the weights come from memory, as in a decode
// step), best of 5. Figures: docs/performance.md.
//
//   c++ -O3 -std=c++17 -o /tmp/harness scripts/quantized_rows_harness.cpp -lpthread
//   /tmp/harness BITS N K        e.g. 4 576 1536 (SmolLM2's down projection), 8 49152 576
#define MTPLXD_STANDALONE
#include "../engine/native/quantized_rows.cpp"

#include <chrono>
#include <cstdio>
#include <random>

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s BITS N K\n", argv[0]);
    return 2;
  }
  const int bits = std::atoi(argv[1]), n = std::atoi(argv[2]), k = std::atoi(argv[3]), copies = 100;
  const size_t weight_bytes = size_t(n) * k * bits / 8, groups = size_t(n) * k / 32;
  std::vector<uint8_t> w(weight_bytes * copies);
  std::vector<float> scales(groups * copies, 0.01f), biases(groups * copies, -0.05f), x(32 * size_t(k)), out(32 * size_t(n));
  std::mt19937 random(0);
  for (auto& byte : w) byte = uint8_t(random());
  for (auto& value : x) value = float(random() % 100) / 50.0f;
  for (int m : {1, 2, 4, 8, 16, 32}) {
    double best = 1e30;
    for (int round = 0; round < 5; ++round) {
      auto start = std::chrono::steady_clock::now();
      for (int c = 0; c < copies; ++c)
        compute(Problem{x.data(), w.data() + c * weight_bytes, scales.data() + c * groups, biases.data() + c * groups,
                        out.data(), m, n, k, 32, bits, n});
      best = std::min(best, std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / copies);
    }
    std::printf("%d-bit %d x %d, %d rows: %.1f us, %.1f GMAC/s (%s)\n", bits, n, k, m, best, double(n) * k * m / best / 1e3,
                level_name(level));
  }
}
