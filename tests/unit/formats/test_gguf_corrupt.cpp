// GGUF reader on broken files: every error is a FormatError naming the file and the offset of
// the bad field, and nothing crashes or allocates what a fuzzed count asks for.
#include <gtest/gtest.h>

#include "core/error.h"
#include "format_writers.h"
#include "formats/gguf.h"

namespace ds {
namespace {

using test::Bytes;
using test::catch_format_error;
using test::GgufBuilder;
using test::GgufLayout;
using test::put_at;

// A valid file with a few kinds of metadata and three tensors.
GgufBuilder sample() {
  GgufBuilder b;
  b.kv_str("general.architecture", "llama")
      .kv<uint32_t>("llama.block_count", GgufType::U32, 2)
      .kv_str_array("tokenizer.ggml.tokens", {"a", "bc", "<s>"})
      .kv_array<float>("tokenizer.ggml.scores", GgufType::F32, {0.5f, 1, 2})
      .kv<uint8_t>("flag", GgufType::Bool, 0);
  b.tensor({"w", {8, 2}, 0, test::f32_bytes(std::vector<float>(16, 1.0f)), {}});
  b.tensor({"q", {32, 2}, 8, std::vector<uint8_t>(68, 3), {}});
  b.tensor({"n", {8}, 0, test::f32_bytes(std::vector<float>(8, 2.0f)), {}});
  return b;
}

// Parses and returns the FormatError, checking the message names the file and the offset.
std::optional<FormatError> parse_error(const std::vector<uint8_t>& bytes) {
  auto e = catch_format_error([&] { GgufFile::parse(bytes, "bad.gguf"); });
  if (e) {
    const std::string msg = e->what();
    EXPECT_NE(msg.find("bad.gguf"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offset"), std::string::npos) << msg;
    EXPECT_EQ(e->file(), "bad.gguf");
  }
  return e;
}

void expect_error_at(const std::vector<uint8_t>& bytes, uint64_t offset, const std::string& text) {
  const auto e = parse_error(bytes);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->offset(), offset) << e->what();
  EXPECT_NE(std::string(e->what()).find(text), std::string::npos) << e->what();
}

TEST(GgufCorrupt, SampleIsValid) {
  GgufLayout l;
  const auto bytes = sample().build(&l);
  const GgufFile f = GgufFile::parse(bytes, "ok.gguf");
  EXPECT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.data_offset(), l.data_start);
}

TEST(GgufCorrupt, EveryTruncationThrows) {
  GgufLayout l;
  const auto bytes = sample().build(&l);
  std::vector<size_t> cuts;
  for (size_t i = 0; i <= l.data_start; ++i) cuts.push_back(i);
  for (size_t i : {l.data_start + 1, l.data_start + 63, bytes.size() / 2, bytes.size() - 1})
    cuts.push_back(i);
  for (const size_t cut : cuts) {
    SCOPED_TRACE("cut at " + std::to_string(cut));
    // An exact-size copy so a read past the end would touch memory outside the buffer.
    const std::vector<uint8_t> part(bytes.begin(), bytes.begin() + long(cut));
    const auto e = parse_error(part);
    if (e) {
      EXPECT_LE(e->offset(), cut);
    }
  }
}

TEST(GgufCorrupt, BadMagic) {
  auto bytes = sample().build();
  bytes[0] = 'X';
  expect_error_at(bytes, 0, "bad magic");
}

TEST(GgufCorrupt, Version1Rejected) {
  auto b = sample();
  b.version = 1;
  expect_error_at(b.build(), 4, "version 1 is not supported");
}

TEST(GgufCorrupt, UnknownAndBigEndianVersions) {
  auto b = sample();
  b.version = 4;
  expect_error_at(b.build(), 4, "unsupported GGUF version 4");
  b.version = 0x03000000;
  expect_error_at(b.build(), 4, "big-endian");
}

TEST(GgufCorrupt, HugeCounts) {
  for (const uint64_t n : {uint64_t(1) << 60, ~uint64_t(0), uint64_t(1000)}) {
    auto b = sample();
    b.tensor_count = n;
    expect_error_at(b.build(), 8, "tensor count");
    b = sample();
    b.kv_count = n;
    expect_error_at(b.build(), 16, "metadata count");
  }
}

TEST(GgufCorrupt, CountsLargerThanWhatFollows) {
  auto b = sample();
  b.kv_count = 6;  // one more than written: the reader runs into the tensor infos
  EXPECT_TRUE(parse_error(b.build()));
  b = sample();
  b.tensor_count = 4;
  EXPECT_TRUE(parse_error(b.build()));
}

TEST(GgufCorrupt, HugeStringLengths) {
  GgufLayout l;
  auto bytes = sample().build(&l);
  auto key_len = bytes;
  put_at<uint64_t>(key_len, l.kv_pos[0], uint64_t(1) << 60);
  expect_error_at(key_len, l.kv_pos[0], "metadata key length");
  // The string value of general.architecture starts after its key and type.
  const size_t value_at = l.kv_pos[0] + 8 + std::string("general.architecture").size() + 4;
  auto value_len = bytes;
  put_at<uint64_t>(value_len, value_at, ~uint64_t(0));
  expect_error_at(value_len, value_at, "runs past end of file");
  auto name_len = bytes;
  put_at<uint64_t>(name_len, l.info_pos[1], uint64_t(1) << 60);
  expect_error_at(name_len, l.info_pos[1], "tensor name length");
}

TEST(GgufCorrupt, HugeArrayCounts) {
  for (const GgufType elem : {GgufType::U8, GgufType::I64, GgufType::Bool, GgufType::String,
                              GgufType::Array, GgufType::F64}) {
    GgufBuilder b;
    Bytes v;
    v.put<uint32_t>(uint32_t(elem)).put<uint64_t>(uint64_t(1) << 60);
    b.kv_raw("arr", uint32_t(GgufType::Array), v);
    GgufLayout l;
    const auto bytes = b.build(&l);
    expect_error_at(bytes, l.kv_pos[0] + 8 + 3 + 4 + 4, "more than the");
  }
  // A huge count in an array nested inside another array.
  GgufBuilder b;
  Bytes v;
  v.put<uint32_t>(uint32_t(GgufType::Array)).put<uint64_t>(1);
  v.put<uint32_t>(uint32_t(GgufType::U32)).put<uint64_t>(uint64_t(1) << 62);
  b.kv_raw("nest", uint32_t(GgufType::Array), v);
  EXPECT_TRUE(parse_error(b.build()));
}

TEST(GgufCorrupt, DeeplyNestedArrays) {
  GgufBuilder b;
  Bytes v;
  for (int i = 0; i < 100; ++i) v.put<uint32_t>(uint32_t(GgufType::Array)).put<uint64_t>(1);
  v.put<uint32_t>(uint32_t(GgufType::U8)).put<uint64_t>(0);
  b.kv_raw("deep", uint32_t(GgufType::Array), v);
  const auto e = parse_error(b.build());
  ASSERT_TRUE(e);
  EXPECT_NE(std::string(e->what()).find("deeper"), std::string::npos) << e->what();
}

TEST(GgufCorrupt, UnknownValueTypeAndBadBool) {
  GgufLayout l;
  auto bytes = sample().build(&l);
  const size_t type_at = l.kv_pos[1] + 8 + std::string("llama.block_count").size();
  put_at<uint32_t>(bytes, type_at, 13);
  expect_error_at(bytes, type_at, "unknown type of metadata key 'llama.block_count' 13");

  GgufBuilder b;
  b.kv<uint8_t>("flag", GgufType::Bool, 2);
  b.build(&l);
  expect_error_at(b.build(), l.kv_pos[0] + 8 + 4 + 4, "not 0 or 1");

  GgufBuilder arr;
  arr.kv_array<uint32_t>("a", GgufType::U32, {1});
  arr.build(&l);
  auto arr_bytes = arr.build();
  put_at<uint32_t>(arr_bytes, l.kv_pos[0] + 8 + 1 + 4, 99);
  expect_error_at(arr_bytes, l.kv_pos[0] + 8 + 1 + 4, "element type 99");
}

TEST(GgufCorrupt, DuplicateKeyAndTensorName) {
  GgufBuilder b;
  b.kv<uint32_t>("k", GgufType::U32, 1).kv<uint32_t>("k", GgufType::U32, 2);
  GgufLayout l;
  b.build(&l);
  expect_error_at(b.build(), l.kv_pos[1], "duplicate metadata key 'k'");

  GgufBuilder t;
  t.tensor({"w", {4}, 0, test::f32_bytes({1, 2, 3, 4}), {}});
  t.tensor({"w", {4}, 0, test::f32_bytes({1, 2, 3, 4}), {}});
  t.build(&l);
  expect_error_at(t.build(), l.info_pos[1], "duplicate tensor name 'w'");
}

TEST(GgufCorrupt, BadAlignment) {
  for (const uint32_t a : {0u, 3u, 48u, 0x80000001u}) {
    GgufBuilder b;
    b.kv<uint32_t>("general.alignment", GgufType::U32, a);
    GgufLayout l;
    b.build(&l);
    expect_error_at(b.build(), l.kv_pos[0] + 8 + 17 + 4, "power-of-two");
  }
  GgufBuilder s;
  s.kv_str("general.alignment", "32");
  EXPECT_TRUE(parse_error(s.build()));
  GgufBuilder neg;
  neg.kv<int32_t>("general.alignment", GgufType::I32, -32);
  EXPECT_TRUE(parse_error(neg.build()));
}

TEST(GgufCorrupt, MisalignedOffset) {
  auto b = sample();
  GgufLayout l;
  auto bytes = b.build(&l);
  put_at<uint64_t>(bytes, l.offset_pos[1], 64 + 4);
  expect_error_at(bytes, l.offset_pos[1], "not a multiple of the alignment 32");
}

TEST(GgufCorrupt, OverlappingTensors) {
  GgufBuilder b;
  b.tensor({"a", {16}, 0, test::f32_bytes(std::vector<float>(16, 1)), uint64_t(0)});
  b.tensor({"b", {8}, 0, test::f32_bytes(std::vector<float>(8, 2)), uint64_t(32)});
  GgufLayout l;
  const auto bytes = b.build(&l);
  expect_error_at(bytes, l.offset_pos[1], "overlaps tensor 'a'");
  // Same start, listed in the other order.
  GgufBuilder c;
  c.tensor({"b", {8}, 0, test::f32_bytes(std::vector<float>(8, 2)), uint64_t(0)});
  c.tensor({"a", {16}, 0, test::f32_bytes(std::vector<float>(16, 1)), uint64_t(0)});
  EXPECT_TRUE(parse_error(c.build()));
  // Empty tensors overlap nothing.
  GgufBuilder d;
  d.tensor({"a", {8}, 0, test::f32_bytes(std::vector<float>(8, 1)), uint64_t(0)});
  d.tensor({"e", {0}, 0, {}, uint64_t(0)});
  const auto ok = d.build();
  EXPECT_NO_THROW(GgufFile::parse(ok, "ok.gguf"));
}

TEST(GgufCorrupt, TensorOutOfRange) {
  GgufLayout l;
  auto bytes = sample().build(&l);
  auto far = bytes;
  put_at<uint64_t>(far, l.offset_pos[2], uint64_t(1) << 40);
  expect_error_at(far, l.offset_pos[2], "runs past the end of the file");
  auto wrap = bytes;
  put_at<uint64_t>(wrap, l.offset_pos[2], ~uint64_t(0) - 31);  // offset + size wraps around
  expect_error_at(wrap, l.offset_pos[2], "runs past the end of the file");
  auto big = bytes;
  put_at<uint64_t>(big, l.ndims_pos[2] + 4, 1 << 20);  // 1M floats in a small file
  expect_error_at(big, l.offset_pos[2], "runs past the end of the file");
}

TEST(GgufCorrupt, UnknownTypeId) {
  for (const uint32_t id : {4u, 16u, 99u, 0xffffffffu}) {
    GgufLayout l;
    auto bytes = sample().build(&l);
    put_at<uint32_t>(bytes, l.type_pos[0], id);
    expect_error_at(bytes, l.type_pos[0], "ggml type id " + std::to_string(id));
  }
}

TEST(GgufCorrupt, TooManyDims) {
  GgufBuilder b;
  b.tensor({"five", {1, 1, 1, 1, 4}, 0, test::f32_bytes({1, 2, 3, 4}), {}});
  GgufLayout l;
  b.build(&l);
  expect_error_at(b.build(), l.ndims_pos[0], "5 dimensions");
  auto bytes = sample().build(&l);
  put_at<uint32_t>(bytes, l.ndims_pos[0], 0xffffffffu);
  expect_error_at(bytes, l.ndims_pos[0], "dimensions");
}

TEST(GgufCorrupt, HugeDimsOverflow) {
  GgufBuilder a;
  a.tensor({"big", {uint64_t(1) << 63}, 0, {}, {}});
  GgufLayout l;
  a.build(&l);
  expect_error_at(a.build(), l.ndims_pos[0] + 4, "too large");

  GgufBuilder b;
  b.tensor({"prod", {uint64_t(1) << 32, uint64_t(1) << 32}, 0, {}, {}});
  b.build(&l);
  expect_error_at(b.build(), l.ndims_pos[0] + 4, "element count overflows");

  GgufBuilder c;  // numel fits in int64 but its byte size does not
  c.tensor({"bytes", {uint64_t(1) << 62}, 0, {}, {}});
  c.build(&l);
  expect_error_at(c.build(), l.ndims_pos[0] + 4, "element count overflows");

  GgufBuilder e;  // empty, but a view's strides would overflow
  e.tensor({"empty", {uint64_t(1) << 40, 0, uint64_t(1) << 30}, 0, {}, {}});
  e.build(&l);
  expect_error_at(e.build(), l.ndims_pos[0] + 4, "element count overflows");

  GgufBuilder d;  // fits in 64 bits, not in the file
  d.tensor({"fits", {uint64_t(1) << 40, 4}, 0, {}, {}});
  d.build(&l);
  expect_error_at(d.build(), l.offset_pos[0], "past the end");
}

TEST(GgufCorrupt, PartialQuantBlock) {
  GgufBuilder b;
  b.tensor({"q", {33, 2}, 8, std::vector<uint8_t>(68, 0), {}});
  GgufLayout l;
  b.build(&l);
  expect_error_at(b.build(), l.ndims_pos[0] + 4, "not a whole number of Q8_0 blocks");
}

}  // namespace
}  // namespace ds
