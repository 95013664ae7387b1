// Runs deepserve's CPU forward on token sequences and dumps the logits, for
// tools/compare_exact.py and tools/accuracy_vs_llamacpp.py. Not part of the build: compile it
// by hand against a build dir's static libraries (both scripts do this when given --build):
//
//   c++ -std=c++20 -O2 -I src tools/dump_logits.cpp build/libdeepserve_lib.a
//       build/libdeepserve_cpu.a build/libdeepserve_tokenizer.a build/libdeepserve_formats.a
//       -lpcre2-8 -lpthread -o /tmp/dump_logits        (one line)
//
// Usage: dump_logits MODEL.gguf --out LOGITS.f32 [--precision f32|q8] [--threads N]
//                    [--kv-cache-dtype f32|f16|bf16|fp8] [--greedy N]
//                    (--ids ID... | --ids-file FILE)
// Each sequence (--ids, or one line of whitespace-separated ids in FILE) is run as one
// prefill from an empty KV cache (model/accuracy.h's prefill_logits, the same path as
// `deepserve accuracy`); the logits of all rows of all sequences, [sum of lengths, vocab]
// float32 little-endian, go to LOGITS.f32. With --greedy N (one sequence only) the prompt is
// then continued greedily by N tokens (argmax, lowest id on ties, a fresh prefill per token)
// and {"generated": [...], "text": "..."} is printed on stdout.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "model/accuracy.h"
#include "model/loader.h"
#include "tokenizer/tokenizer.h"

namespace {

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "dump_logits: %s\nusage: dump_logits MODEL.gguf --out FILE [--precision f32|q8] "
               "[--threads N] [--kv-cache-dtype f32|f16|bf16|fp8] [--greedy N] "
               "(--ids ID... | --ids-file FILE)\n",
               why);
  std::exit(2);
}

struct Args {
  std::string model, out;
  ds::ActivationPrecision precision = ds::ActivationPrecision::F32;
  ds::DType kv = ds::DType::F32;
  int threads = 2, greedy = 0;
  std::vector<std::vector<int32_t>> seqs;
};

ds::DType kv_dtype(const std::string& s) {
  if (s == "f32") return ds::DType::F32;
  if (s == "f16") return ds::DType::F16;
  if (s == "bf16") return ds::DType::BF16;
  if (s == "fp8") return ds::DType::F8_E4M3;
  usage("--kv-cache-dtype is f32, f16, bf16 or fp8");
}

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
    } else if (s == "--kv-cache-dtype") {
      a.kv = kv_dtype(next());
    } else if (s == "--threads") {
      a.threads = std::stoi(next());
    } else if (s == "--greedy") {
      a.greedy = std::stoi(next());
    } else if (s == "--ids") {
      a.seqs.emplace_back();
      while (i + 1 < argc && argv[i + 1][0] != '-') a.seqs.back().push_back(std::stoi(argv[++i]));
    } else if (s == "--ids-file") {
      std::ifstream f(next());
      if (!f) usage("cannot read --ids-file");
      for (std::string line; std::getline(f, line);) {
        std::istringstream ls(line);
        std::vector<int32_t> ids;
        for (int32_t id; ls >> id;) ids.push_back(id);
        if (!ids.empty()) a.seqs.push_back(std::move(ids));
      }
    } else if (a.model.empty()) {
      a.model = s;
    } else {
      usage(("unexpected argument " + s).c_str());
    }
  }
  if (a.model.empty() || a.out.empty() || a.seqs.empty())
    usage("model, --out and --ids or --ids-file are required");
  if (a.greedy > 0 && a.seqs.size() != 1) usage("--greedy takes one sequence");
  return a;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  ds::BackendOptions bo;
  bo.threads = a.threads;
  bo.precision = a.precision;
  auto backend = ds::make_cpu_backend(bo);
  ds::LoadedModel m = ds::load_model(a.model, *backend, {});
  std::ofstream out(a.out, std::ios::binary);
  for (const auto& ids : a.seqs) {
    const auto logits = ds::prefill_logits(*m.model, *backend, m.config, ids, a.kv);
    out.write(reinterpret_cast<const char*>(logits.data()), std::streamsize(logits.size() * 4));
  }
  if (!out.flush()) usage("cannot write --out");
  if (a.greedy > 0) {
    const auto& prompt = a.seqs.front();
    const auto seq = ds::greedy_sequence(*m.model, *backend, m.config, prompt, a.greedy, a.kv);
    const std::vector<int32_t> generated(seq.begin() + std::ptrdiff_t(prompt.size()), seq.end());
    nlohmann::json j;
    j["generated"] = generated;
    j["text"] = m.tokenizer ? m.tokenizer->decode(generated) : "";
    std::cout << j.dump() << "\n";
  }
  return 0;
}
