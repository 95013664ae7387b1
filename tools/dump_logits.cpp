// Runs deepserve's CPU forward on one token sequence and dumps the logits, for
// tools/compare_exact.py. Not part of the build: compile it by hand against a build dir's
// static libraries (compare_exact.py does this when given --build):
//
//   c++ -std=c++20 -O2 -I src tools/dump_logits.cpp build/libdeepserve_lib.a
//       build/libdeepserve_cpu.a build/libdeepserve_tokenizer.a build/libdeepserve_formats.a
//       -lpcre2-8 -lpthread -o /tmp/dump_logits        (one line)
//
// Usage: dump_logits MODEL.gguf --out LOGITS.f32 [--precision f32|q8] [--threads N]
//                    [--greedy N] --ids ID...
// Writes the prompt's logits, [num ids, vocab] float32 little-endian, to LOGITS.f32, then
// continues greedily for N tokens (one token per forward, through the KV cache) and prints
// {"generated": [...], "text": "..."} on stdout.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/loader.h"
#include "tokenizer/tokenizer.h"

namespace {

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "dump_logits: %s\nusage: dump_logits MODEL.gguf --out FILE [--precision f32|q8] "
               "[--threads N] [--greedy N] --ids ID...\n",
               why);
  std::exit(2);
}

struct Args {
  std::string model, out;
  ds::ActivationPrecision precision = ds::ActivationPrecision::F32;
  int threads = 2, greedy = 0;
  std::vector<int32_t> ids;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) usage(("missing value after " + s).c_str());
      return argv[++i];
    };
    if (s == "--out") {
      a.out = next();
    } else if (s == "--precision") {
      const std::string p = next();
      if (p != "f32" && p != "q8") usage("precision is f32 or q8");
      a.precision = p == "f32" ? ds::ActivationPrecision::F32 : ds::ActivationPrecision::Q8;
    } else if (s == "--threads") {
      a.threads = std::stoi(next());
    } else if (s == "--greedy") {
      a.greedy = std::stoi(next());
    } else if (s == "--ids") {
      while (i + 1 < argc && argv[i + 1][0] != '-') a.ids.push_back(std::stoi(argv[++i]));
    } else if (a.model.empty()) {
      a.model = s;
    } else {
      usage(("unexpected argument " + s).c_str());
    }
  }
  if (a.model.empty() || a.out.empty() || a.ids.empty())
    usage("model, --out and --ids are required");
  return a;
}

// One forward of `tokens` at positions [start, start + n) of sequence 0, logits for `rows`.
void forward(ds::Model& model, ds::KvCache& cache, const std::vector<int32_t>& tokens, int start,
             const std::vector<int32_t>& rows, const std::vector<int32_t>& table, float* logits) {
  const int n = int(tokens.size());
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) pos[size_t(i)] = start + i;
  const int32_t qs[2] = {0, n}, ctx[1] = {start + n};
  ds::ForwardInput in;
  in.tokens = tokens;
  in.meta.num_seqs = 1;
  in.meta.num_tokens = n;
  in.meta.query_start = qs;
  in.meta.context_lens = ctx;
  in.meta.block_tables = table.data();
  in.meta.max_blocks_per_seq = int(table.size());
  in.meta.slot_mapping = pos.data();  // block b of the table is cache block b
  in.meta.positions = pos.data();
  in.logit_rows = rows;
  const int64_t vocab = model.config().vocab;
  model.forward(in, cache,
                ds::TensorView::contiguous(logits, ds::DType::F32, {int64_t(rows.size()), vocab}));
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  ds::BackendOptions bo;
  bo.threads = a.threads;
  bo.precision = a.precision;
  auto backend = ds::make_cpu_backend(bo);
  ds::LoadedModel m = ds::load_model(a.model, *backend, {});
  const int n = int(a.ids.size()), vocab = m.config.vocab;
  ds::KvCacheConfig kvc;
  kvc.num_blocks = (n + a.greedy) / kvc.block_size + 1;
  ds::KvCache cache(*backend, m.config, kvc);
  std::vector<int32_t> table(static_cast<size_t>(kvc.num_blocks));
  for (int b = 0; b < kvc.num_blocks; ++b) table[size_t(b)] = b;

  std::vector<int32_t> rows(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) rows[size_t(i)] = i;
  std::vector<float> logits(size_t(n) * size_t(vocab));
  forward(*m.model, cache, a.ids, 0, rows, table, logits.data());
  std::ofstream(a.out, std::ios::binary)
      .write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * 4));

  // Greedy: argmax with the lowest id on ties, as the fixtures' np.argmax.
  std::vector<int32_t> generated;
  std::vector<float> last(logits.end() - vocab, logits.end());
  for (int step = 0; step < a.greedy; ++step) {
    int32_t best = 0;
    for (int v = 1; v < vocab; ++v)
      if (last[size_t(v)] > last[size_t(best)]) best = v;
    generated.push_back(best);
    if (step + 1 < a.greedy) forward(*m.model, cache, {best}, n + step, {0}, table, last.data());
  }
  nlohmann::json j;
  j["generated"] = generated;
  j["text"] = m.tokenizer ? m.tokenizer->decode(generated) : "";
  std::cout << j.dump() << "\n";
  return 0;
}
