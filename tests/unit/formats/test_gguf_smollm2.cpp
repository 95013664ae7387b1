// The GGUF reader on the real SmolLM2-135M-Instruct Q4_1 file (path in DS_SMOLLM2_GGUF),
// checked against known facts and against the tensor table gguf-py reads from the same file.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "formats/gguf.h"

namespace ds {
namespace {

const char* model_path() {
  return std::getenv("DS_SMOLLM2_GGUF");
}

constexpr const char* kSkipMessage =
    "set DS_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf to run this";

TEST(GgufSmolLM2, KnownFacts) {
  if (!model_path() || !*model_path()) {
    GTEST_SKIP() << kSkipMessage;
  }
  const GgufFile f = GgufFile::open(model_path());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.tensors().size(), 272u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.block_count"), 30);
  EXPECT_EQ(f.get_int("llama.embedding_length"), 576);
  EXPECT_EQ(f.get_string("tokenizer.ggml.model"), "gpt2");
  EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.merges").size(), 48900u);

  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->dtype, DType::Q8_0);
  const TensorView e = f.view(*embd);
  EXPECT_EQ(e.shape_str(), "[49152, 576]");
  EXPECT_EQ(e.row_stride(), 576 / 32 * 34);
  EXPECT_EQ(e.nbytes(), embd->nbytes);

  const GgufTensorInfo* down = f.find_tensor("blk.0.ffn_down.weight");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->dtype, DType::Q4_1);
  EXPECT_EQ(f.view(*down).shape_str(), "[576, 1536]");

  const GgufTensorInfo* norm = f.find_tensor("blk.29.attn_norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_EQ(norm->dtype, DType::F32);
  EXPECT_EQ(f.view(*norm).shape_str(), "[576]");
}

TEST(GgufSmolLM2, MatchesGgufPyTensorTable) {
  if (!model_path() || !*model_path()) {
    GTEST_SKIP() << kSkipMessage;
  }
  std::ifstream in(std::string(DS_FIXTURES_DIR) + "/formats/smollm2_tensors.json");
  ASSERT_TRUE(in) << "missing fixture; run tools/make_format_fixtures.py --model ...";
  const auto table = nlohmann::json::parse(in);
  const GgufFile f = GgufFile::open(model_path());
  EXPECT_EQ(f.metadata().size(), table["kv_count"].get<size_t>());
  EXPECT_EQ(f.alignment(), table["alignment"].get<uint64_t>());
  EXPECT_EQ(f.data_offset(), table["data_offset"].get<uint64_t>());
  const auto& tensors = table["tensors"];
  ASSERT_EQ(f.tensors().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const GgufTensorInfo& t = f.tensors()[i];
    const auto& ref = tensors[i];
    SCOPED_TRACE(t.name);
    EXPECT_EQ(t.name, ref["name"].get<std::string>());
    EXPECT_EQ(dtype_to_ggml(t.dtype), ref["ggml_type"].get<uint32_t>());
    EXPECT_EQ(t.dims, ref["ne"].get<std::vector<int64_t>>());
    EXPECT_EQ(t.offset, ref["offset"].get<uint64_t>());
    EXPECT_EQ(t.nbytes, ref["nbytes"].get<uint64_t>());
  }
}

}  // namespace
}  // namespace ds
