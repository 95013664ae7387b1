// safetensors reader: single files (valid and broken) and sharded checkpoints.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "format_writers.h"
#include "formats/safetensors.h"

namespace ds {
namespace {

using nlohmann::json;
using test::catch_format_error;
using test::safetensors_bytes;
using test::TempDir;

std::string fixture(const std::string& rel) {
  return std::string(DS_FIXTURES_DIR) + "/formats/" + rel;
}

// Header for tensors laid out back to back: {name: {dtype, shape, nbytes}}.
struct Entry {
  std::string name, dtype;
  std::vector<int64_t> shape;
  uint64_t nbytes;
};
std::string header_for(const std::vector<Entry>& entries, json metadata = nullptr) {
  json h = json::object();
  uint64_t at = 0;
  for (const auto& e : entries) {
    h[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {at, at + e.nbytes}}};
    at += e.nbytes;
  }
  if (!metadata.is_null()) h["__metadata__"] = metadata;
  return h.dump();
}

std::optional<FormatError> parse_error(const std::vector<uint8_t>& bytes) {
  auto e = catch_format_error([&] { SafetensorsFile::parse(bytes, "bad.safetensors"); });
  if (e) {
    const std::string msg = e->what();
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("offset"), std::string::npos) << msg;
  }
  return e;
}

void expect_error(const std::string& header, const std::vector<uint8_t>& data,
                  const std::string& text) {
  const auto e = parse_error(safetensors_bytes(header, data));
  ASSERT_TRUE(e) << header;
  EXPECT_NE(std::string(e->what()).find(text), std::string::npos) << e->what();
}

TEST(Safetensors, ParsesEveryDtype) {
  const std::vector<Entry> entries = {
      {"f64", "F64", {2}, 16},        {"f32", "F32", {2, 3}, 24},    {"f16", "F16", {3}, 6},
      {"bf16", "BF16", {1, 1, 2}, 4}, {"e4m3", "F8_E4M3", {4}, 4},   {"e5m2", "F8_E5M2", {4}, 4},
      {"i64", "I64", {1}, 8},         {"i32", "I32", {2}, 8},        {"i16", "I16", {2}, 4},
      {"i8", "I8", {3}, 3},           {"u8", "U8", {1, 2, 1, 2}, 4}, {"b", "BOOL", {2}, 2},
  };
  const std::string header = header_for(entries, json{{"format", "pt"}});
  std::vector<uint8_t> data(16 + 24 + 6 + 4 + 4 + 4 + 8 + 8 + 4 + 3 + 4 + 2);
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i);
  const auto bytes = safetensors_bytes(header, data);
  const SafetensorsFile f = SafetensorsFile::parse(bytes, "all.safetensors");
  EXPECT_EQ(f.metadata().at("format"), "pt");
  ASSERT_EQ(f.tensors().size(), entries.size());
  const std::vector<DType> types = {DType::F64,     DType::F32,     DType::F16, DType::BF16,
                                    DType::F8_E4M3, DType::F8_E5M2, DType::I64, DType::I32,
                                    DType::I16,     DType::I8,      DType::U8,  DType::Bool};
  const uint64_t data_start = 8 + header.size();
  uint64_t at = data_start;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsTensor& t = f.tensors()[i];  // kept in file order
    SCOPED_TRACE(entries[i].name);
    EXPECT_EQ(t.name, entries[i].name);
    EXPECT_EQ(t.dtype, types[i]);
    EXPECT_EQ(t.shape, entries[i].shape);
    EXPECT_EQ(t.offset, at);
    EXPECT_EQ(t.nbytes, entries[i].nbytes);
    EXPECT_EQ(f.find(t.name), &t);
    const TensorView v = f.view(t);
    EXPECT_EQ(v.nbytes(), t.nbytes);
    EXPECT_EQ(static_cast<const uint8_t*>(v.data), bytes.data() + at);
    EXPECT_TRUE(v.is_contiguous());
    at += t.nbytes;
  }
  const TensorView u8 = f.view(*f.find("u8"));
  EXPECT_EQ(u8.shape_str(), "[1, 2, 1, 2]");
  EXPECT_EQ(u8.stride[0], 4);
  EXPECT_EQ(u8.stride[1], 2);
  EXPECT_EQ(u8.stride[3], 1);
  const TensorView f32 = f.view(*f.find("f32"));
  EXPECT_EQ(f32.stride[0], 12);
  EXPECT_EQ(f32.stride[1], 4);
  EXPECT_EQ(f.find("nope"), nullptr);
}

TEST(Safetensors, ScalarsEmptyTensorsAndPadding) {
  // Trailing spaces in the header are allowed (writers pad it to 8 bytes).
  const std::string header = R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                             R"("e":{"dtype":"F32","shape":[0,4],"data_offsets":[4,4]},)"
                             R"("e2":{"dtype":"I8","shape":[3,0],"data_offsets":[0,0]}}   )";
  const auto bytes = safetensors_bytes(header, test::f32_bytes({2.5f}));
  const SafetensorsFile f = SafetensorsFile::parse(bytes, "s.safetensors");
  ASSERT_EQ(f.tensors().size(), 3u);
  const TensorView s = f.view(*f.find("s"));
  EXPECT_EQ(s.shape_str(), "[1]");
  float value;  // the header is not padded here, so the data is not 4-byte aligned
  std::memcpy(&value, s.data, 4);
  EXPECT_EQ(value, 2.5f);
  EXPECT_EQ(f.view(*f.find("e")).numel(), 0);
  EXPECT_TRUE(f.find("e")->shape == (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(f.metadata().empty());
}

TEST(Safetensors, ReadsFileWrittenBySafetensorsPackage) {
  const SafetensorsFile f = SafetensorsFile::open(fixture("numpy.safetensors"));
  EXPECT_EQ(f.metadata().at("note"), "fixture");
  EXPECT_EQ(f.tensors().size(), 12u);
  const TensorView a = f.view(*f.find("f32"));
  EXPECT_EQ(a.shape_str(), "[2, 3]");
  float row1[3];
  std::memcpy(row1, a.row(1), 12);
  EXPECT_EQ(row1[2], 5.0f);
  const TensorView h = f.view(*f.find("f16"));
  uint16_t last;
  std::memcpy(&last, static_cast<uint8_t*>(h.data) + 6, 2);
  EXPECT_EQ(fp16_to_f32(last), 65504.0f);
  int64_t i64[2];
  std::memcpy(i64, f.view(*f.find("i64")).data, 16);
  EXPECT_EQ(i64[1], int64_t(1) << 40);
  EXPECT_EQ(f.find("bool")->dtype, DType::Bool);
  EXPECT_EQ(f.find("scalar")->shape.size(), 0u);
  EXPECT_EQ(f.view(*f.find("cube")).shape_str(), "[2, 3, 4]");
  EXPECT_EQ(f.find("empty")->nbytes, 0u);
}

TEST(SafetensorsCorrupt, HeaderLength) {
  EXPECT_TRUE(parse_error({}));
  EXPECT_TRUE(parse_error({1, 2, 3}));
  const std::string h = header_for({{"x", "F32", {1}, 4}});
  auto e = parse_error(safetensors_bytes(h, {0, 0, 0, 0}, h.size() + 5));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->offset(), 0u);
  EXPECT_NE(std::string(e->what()).find("runs past the end"), std::string::npos);
  EXPECT_TRUE(parse_error(safetensors_bytes(h, {}, ~uint64_t(0))));
  // Over the 100 MB limit while inside the file: checked without reading the header.
  std::vector<uint8_t> big(8 + (size_t(100) << 20) + 16, ' ');
  test::put_at<uint64_t>(big, 0, (uint64_t(100) << 20) + 1);
  e = parse_error(big);
  ASSERT_TRUE(e);
  EXPECT_NE(std::string(e->what()).find("limit"), std::string::npos);
}

TEST(SafetensorsCorrupt, EveryTruncationThrows) {
  const std::string h = header_for({{"a", "F32", {2}, 8}, {"b", "I8", {3}, 3}});
  const auto bytes = safetensors_bytes(h, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  ASSERT_NO_THROW(SafetensorsFile::parse(bytes, "ok"));
  for (size_t cut = 0; cut < bytes.size(); ++cut) {
    SCOPED_TRACE(cut);
    const std::vector<uint8_t> part(bytes.begin(), bytes.begin() + long(cut));
    parse_error(part);
  }
}

TEST(SafetensorsCorrupt, NotJson) {
  const auto e = parse_error(safetensors_bytes("{\"a\": nope}", {}));
  ASSERT_TRUE(e);
  EXPECT_NE(std::string(e->what()).find("invalid JSON"), std::string::npos);
  EXPECT_EQ(e->offset(), 8u + 7);  // "nope" is not "null" from its 'o', header byte 7
  EXPECT_TRUE(parse_error(safetensors_bytes("", {})));
  EXPECT_TRUE(parse_error(safetensors_bytes("{\"a\":", {})));
  EXPECT_TRUE(parse_error(safetensors_bytes(std::string("{\0}", 3), {})));
  EXPECT_TRUE(parse_error(safetensors_bytes(R"({"a": 9e99999})", {})));  // number overflow
  expect_error(std::string(100000, '[') + std::string(100000, ']'), {}, "nests deeper than");
  expect_error("{\"a\":" + std::string(40, '[') + std::string(40, ']') + "}", {}, "deeper");
}

TEST(SafetensorsCorrupt, JsonNotAnObject) {
  expect_error("[1, 2]", {}, "not a JSON object");
  expect_error("42", {}, "not a JSON object");
  expect_error(R"({"x": [1]})", {}, "entry is not a JSON object");
  expect_error(R"({"__metadata__": [1]})", {}, "__metadata__ is not a JSON object");
  expect_error(R"({"__metadata__": {"a": 1}})", {}, "is not a string");
}

TEST(SafetensorsCorrupt, DuplicateKeys) {
  expect_error(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
               R"("x":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
               {1, 2}, "duplicate key \"x\"");
  expect_error(R"({"x":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}})", {1},
               "duplicate key \"dtype\"");
}

TEST(SafetensorsCorrupt, WrongDtype) {
  expect_error(header_for({{"x", "Q4_0", {32}, 18}}), std::vector<uint8_t>(18), "unknown dtype");
  expect_error(header_for({{"x", "f32", {1}, 4}}), std::vector<uint8_t>(4), "unknown dtype");
  expect_error(R"({"x":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", {1}, "missing dtype");
  expect_error(R"({"x":{"shape":[1],"data_offsets":[0,1]}})", {1}, "missing dtype");
}

TEST(SafetensorsCorrupt, ShapeSizeMismatch) {
  expect_error(header_for({{"x", "F32", {2, 3}, 20}}), std::vector<uint8_t>(20), "needs 24 bytes");
  expect_error(header_for({{"x", "BF16", {4}, 16}}), std::vector<uint8_t>(16), "needs 8 bytes");
  expect_error(R"({"x":{"dtype":"U8","data_offsets":[0,1]}})", {1}, "missing shape");
  expect_error(R"({"x":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", {1}, "not an integer");
  expect_error(R"({"x":{"dtype":"U8","shape":["1"],"data_offsets":[0,1]}})", {1}, "not an integer");
}

TEST(SafetensorsCorrupt, NegativeAndOverflowingDims) {
  expect_error(R"({"x":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", {1},
               "negative dimension");
  expect_error(R"({"x":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", {1},
               "overflows");
  expect_error(R"({"x":{"dtype":"U8","shape":[18446744073709551615],"data_offsets":[0,1]}})", {1},
               "overflows");
  expect_error(R"({"x":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,1]}})", {1},
               "overflows");
  expect_error(R"({"x":{"dtype":"U8","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})",
               {1}, "overflows");
  expect_error(R"({"x":{"dtype":"U8","shape":[1e30],"data_offsets":[0,1]}})", {1},
               "not an integer");
}

TEST(SafetensorsCorrupt, BadDataOffsets) {
  expect_error(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[1,0]}})", {1, 2},
               "is before begin");
  expect_error(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", {1}, "data_offsets");
  expect_error(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[-1,0]}})", {1}, "data_offsets");
  expect_error(R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", {1}, "data_offsets");
  expect_error(R"({"x":{"dtype":"U8","shape":[1]}})", {1}, "data_offsets");
}

TEST(SafetensorsCorrupt, OutOfBounds) {
  expect_error(header_for({{"x", "F32", {4}, 16}}), std::vector<uint8_t>(15), "past the end");
  expect_error(
      R"({"x":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]}})",
      {1}, "past the end");
}

TEST(SafetensorsCorrupt, Overlap) {
  const std::string h = R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}})";
  const auto e = parse_error(safetensors_bytes(h, std::vector<uint8_t>(5)));
  ASSERT_TRUE(e);
  EXPECT_NE(std::string(e->what()).find("overlaps"), std::string::npos) << e->what();
  EXPECT_EQ(e->offset(), 8 + h.size() + 3);
  // Identical ranges overlap; a zero-size tensor inside another does not.
  expect_error(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
               R"("b":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})",
               {1, 2}, "overlaps");
  const auto ok = safetensors_bytes(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                    R"("z":{"dtype":"U8","shape":[0],"data_offsets":[1,1]}})",
                                    {1, 2});
  EXPECT_NO_THROW(SafetensorsFile::parse(ok, "ok"));
}

// ---- checkpoints ---------------------------------------------------------------

std::vector<uint8_t> small_file(const std::string& name, float value) {
  return safetensors_bytes(header_for({{name, "F32", {1}, 4}}), test::f32_bytes({value}));
}

TEST(SafetensorsCheckpoint, ShardedFixture) {
  const auto c = SafetensorsCheckpoint::open(fixture("sharded"));
  EXPECT_EQ(c.shards().size(), 2u);
  EXPECT_EQ(c.tensor_names(), (std::vector<std::string>{"a.weight", "b.weight", "c.bias"}));
  EXPECT_TRUE(c.contains("b.weight"));
  EXPECT_FALSE(c.contains("d"));
  EXPECT_EQ(c.tensor("b.weight").dtype, DType::F16);
  EXPECT_EQ(c.view("a.weight").shape_str(), "[2, 2]");
  EXPECT_EQ(c.total_bytes(), 16u + 6 + 8);
  int64_t bias;
  std::memcpy(&bias, c.view("c.bias").data, 8);
  EXPECT_EQ(bias, 9);
  try {
    (void)c.tensor("d");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'d'"), std::string::npos);
  }
  EXPECT_THROW(c.view("d"), Error);
}

TEST(SafetensorsCheckpoint, SingleFileFolderAndPath) {
  TempDir dir;
  const auto p = dir.write("model.safetensors", small_file("w", 3.0f));
  for (const auto& path : {dir.path(), p}) {
    const auto c = SafetensorsCheckpoint::open(path);
    EXPECT_EQ(c.dir(), dir.path());
    EXPECT_EQ(c.tensor_names(), std::vector<std::string>{"w"});
    EXPECT_EQ(test::load<float>(c.view("w").data), 3.0f);
  }
  const auto other = dir.write("sub/other-name.safetensors", small_file("v", 1.0f));
  EXPECT_TRUE(SafetensorsCheckpoint::open(other).contains("v"));
}

TEST(SafetensorsCheckpoint, ErrorsNameWhatWasLookedFor) {
  TempDir dir;
  try {
    SafetensorsCheckpoint::open(dir.path());
    ADD_FAILURE();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.safetensors.index.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.safetensors)"), std::string::npos) << msg;
  }
  EXPECT_THROW(SafetensorsCheckpoint::open(dir.path() / "nope"), Error);
}

void expect_index_error(const std::string& index, const std::string& text) {
  TempDir dir;
  dir.write("s1.safetensors", small_file("a", 1.0f));
  dir.write("model.safetensors.index.json", std::vector<uint8_t>(index.begin(), index.end()));
  try {
    SafetensorsCheckpoint::open(dir.path());
    ADD_FAILURE() << "no error for " << index;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("model.safetensors.index.json"), std::string::npos)
        << e.what();
  }
}

TEST(SafetensorsCheckpoint, BadIndex) {
  expect_index_error(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})",
                     "s2.safetensors");
  expect_index_error(R"({"weight_map": {"b": "s1.safetensors"}})", "does not contain it");
  expect_index_error(R"({"weight_map": {"a": "../s1.safetensors"}})", "not a relative path");
  expect_index_error(R"({"weight_map": {"a": "x/../../s1.safetensors"}})", "not a relative path");
  expect_index_error(R"({"weight_map": {"a": "/etc/passwd"}})", "not a relative path");
  expect_index_error(R"({"weight_map": {"a": ""}})", "not a relative path");
  expect_index_error(R"({"weight_map": {"a": 3}})", "not a string");
  expect_index_error(R"({"weight_map": {}})", "weight_map");
  expect_index_error(R"({"metadata": {}})", "weight_map");
  expect_index_error(R"([])", "weight_map");
  expect_index_error(R"({"weight_map": )", "invalid JSON");
}

TEST(SafetensorsCheckpoint, ShardInSubfolderAndBrokenShard) {
  TempDir dir;
  dir.write("parts/s1.safetensors", small_file("a", 1.0f));
  const std::string index = R"({"weight_map": {"a": "parts/s1.safetensors"}})";
  dir.write_text("model.safetensors.index.json", index);
  EXPECT_EQ(test::load<float>(SafetensorsCheckpoint::open(dir.path()).view("a").data), 1.0f);

  dir.write("parts/s1.safetensors", {1, 2, 3});  // truncated shard
  EXPECT_THROW(SafetensorsCheckpoint::open(dir.path()), FormatError);
}

}  // namespace
}  // namespace ds
