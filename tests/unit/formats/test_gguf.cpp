// GGUF reader on well-formed files: every metadata type, alignments, versions, views, getters.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/error.h"
#include "format_writers.h"
#include "formats/gguf.h"

namespace ds {
namespace {

using test::Bytes;
using test::GgufBuilder;
using test::GgufLayout;

// One key of every scalar type, arrays of every element type, a nested and an empty array.
GgufBuilder all_types_builder(uint32_t version) {
  GgufBuilder b;
  b.version = version;
  b.kv<uint8_t>("t.u8", GgufType::U8, 200)
      .kv<int8_t>("t.i8", GgufType::I8, -100)
      .kv<uint16_t>("t.u16", GgufType::U16, 60000)
      .kv<int16_t>("t.i16", GgufType::I16, -30000)
      .kv<uint32_t>("t.u32", GgufType::U32, 4000000000u)
      .kv<int32_t>("t.i32", GgufType::I32, -2000000000)
      .kv<float>("t.f32", GgufType::F32, 1.5f)
      .kv<uint8_t>("t.bool", GgufType::Bool, 1)
      .kv_str("t.str", "h\xc3\xa9llo\n\"q\"")
      .kv<uint64_t>("t.u64", GgufType::U64, (uint64_t(1) << 63) + 5)
      .kv<int64_t>("t.i64", GgufType::I64, -(int64_t(1) << 62))
      .kv<double>("t.f64", GgufType::F64, -2.25e300)
      .kv_array<uint8_t>("a.u8", GgufType::U8, {1, 2, 255})
      .kv_array<int8_t>("a.i8", GgufType::I8, {-128, 127})
      .kv_array<uint16_t>("a.u16", GgufType::U16, {65535})
      .kv_array<int16_t>("a.i16", GgufType::I16, {-1, 2, -3})
      .kv_array<uint32_t>("a.u32", GgufType::U32, {0, 4294967295u})
      .kv_array<int32_t>("a.i32", GgufType::I32, {7, -8, 9})
      .kv_array<float>("a.f32", GgufType::F32, {0.25f, 4.0f})
      .kv_array<uint8_t>("a.bool", GgufType::Bool, {1, 0, 1})
      .kv_str_array("a.str", {"a", "", "ccc"})
      .kv_array<uint64_t>("a.u64", GgufType::U64, {~uint64_t(0), 3})
      .kv_array<int64_t>("a.i64", GgufType::I64, {std::numeric_limits<int64_t>::min()})
      .kv_array<double>("a.f64", GgufType::F64, {0.5, -1.0})
      .kv_array<int32_t>("a.empty", GgufType::I32, {});
  // [[1, 2], [["x"]]]: an array of two arrays, the second itself nested.
  Bytes nested;
  nested.put<uint32_t>(uint32_t(GgufType::Array)).put<uint64_t>(2);
  nested.put<uint32_t>(uint32_t(GgufType::I32)).put<uint64_t>(2).put<int32_t>(1).put<int32_t>(2);
  nested.put<uint32_t>(uint32_t(GgufType::Array)).put<uint64_t>(1);
  nested.put<uint32_t>(uint32_t(GgufType::String)).put<uint64_t>(1).str("x");
  b.kv_raw("a.nested", uint32_t(GgufType::Array), nested);
  return b;
}

class GgufVersions : public testing::TestWithParam<uint32_t> {};

TEST_P(GgufVersions, ReadsEveryMetadataType) {
  const auto bytes = all_types_builder(GetParam()).build();
  const GgufFile f = GgufFile::parse(bytes, "all.gguf");
  EXPECT_EQ(f.version(), GetParam());
  EXPECT_EQ(f.metadata().size(), 26u);
  EXPECT_TRUE(f.tensors().empty());

  EXPECT_EQ(f.get_int("t.u8"), 200);
  EXPECT_EQ(f.get_int("t.i8"), -100);
  EXPECT_EQ(f.get_int("t.u16"), 60000);
  EXPECT_EQ(f.get_int("t.i16"), -30000);
  EXPECT_EQ(f.get_int("t.u32"), 4000000000LL);
  EXPECT_EQ(f.get_int("t.i32"), -2000000000);
  EXPECT_EQ(f.get_float("t.f32"), 1.5);
  EXPECT_EQ(f.get_bool("t.bool"), true);
  EXPECT_EQ(f.get_string("t.str"), "h\xc3\xa9llo\n\"q\"");
  EXPECT_EQ(std::get<uint64_t>(f.find("t.u64")->value), (uint64_t(1) << 63) + 5);
  EXPECT_EQ(f.find("t.u64")->as_int(), std::nullopt);  // does not fit int64
  EXPECT_THROW(f.get_int("t.u64"), Error);
  EXPECT_EQ(f.get_int("t.i64"), -(int64_t(1) << 62));
  EXPECT_EQ(f.get_float("t.f64"), -2.25e300);
  EXPECT_EQ(f.get_float("t.i32"), -2e9);  // integers read as floats too

  EXPECT_EQ(f.find("t.u8")->type, GgufType::U8);
  EXPECT_EQ(f.find("t.f32")->type, GgufType::F32);
  EXPECT_EQ(f.find("t.bool")->as_int(), 1);
  EXPECT_EQ(f.find("t.str")->as_float(), std::nullopt);
  EXPECT_EQ(f.find("t.i16")->as_string(), std::nullopt);

  EXPECT_EQ(f.get_int_array("a.u8"), (std::vector<int64_t>{1, 2, 255}));
  EXPECT_EQ(f.get_int_array("a.i8"), (std::vector<int64_t>{-128, 127}));
  EXPECT_EQ(f.get_int_array("a.u16"), (std::vector<int64_t>{65535}));
  EXPECT_EQ(f.get_int_array("a.i16"), (std::vector<int64_t>{-1, 2, -3}));
  EXPECT_EQ(f.get_int_array("a.u32"), (std::vector<int64_t>{0, 4294967295LL}));
  EXPECT_EQ(f.get_int_array("a.i32"), (std::vector<int64_t>{7, -8, 9}));
  EXPECT_EQ(f.get_float_array("a.f32"), (std::vector<double>{0.25, 4.0}));
  EXPECT_EQ(f.get_int_array("a.bool"), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(f.find("a.bool")->array_type, GgufType::Bool);
  EXPECT_EQ(f.get_string_array("a.str"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_THROW(f.get_int_array("a.u64"), Error);  // 2^64-1 does not fit
  EXPECT_EQ(std::get<std::vector<uint64_t>>(f.find("a.u64")->value)[0], ~uint64_t(0));
  EXPECT_EQ(f.get_int_array("a.i64"), (std::vector<int64_t>{std::numeric_limits<int64_t>::min()}));
  EXPECT_EQ(f.get_float_array("a.f64"), (std::vector<double>{0.5, -1.0}));
  EXPECT_EQ(f.get_float_array("a.i32"), (std::vector<double>{7, -8, 9}));
  EXPECT_EQ(f.find("a.empty")->array_size(), 0u);
  EXPECT_EQ(f.find("a.empty")->array_type, GgufType::I32);

  const GgufValue* nested = f.find("a.nested");
  ASSERT_NE(nested, nullptr);
  EXPECT_EQ(nested->type, GgufType::Array);
  EXPECT_EQ(nested->array_type, GgufType::Array);
  EXPECT_EQ(nested->array_size(), 2u);
  EXPECT_EQ(f.find("t.u8")->array_size(), 0u);
}

INSTANTIATE_TEST_SUITE_P(V2AndV3, GgufVersions, testing::Values(2u, 3u));

TEST(Gguf, ValueToString) {
  const auto bytes = all_types_builder(3).build();
  const GgufFile f = GgufFile::parse(bytes, "all.gguf");
  EXPECT_EQ(f.find("t.i8")->to_string(), "-100");
  EXPECT_EQ(f.find("t.u32")->to_string(), "4000000000");
  EXPECT_EQ(f.find("t.f32")->to_string(), "1.5");
  EXPECT_EQ(f.find("t.bool")->to_string(), "true");
  EXPECT_EQ(f.find("t.str")->to_string(), "\"h\xc3\xa9llo\\n\\\"q\\\"\"");
  EXPECT_EQ(f.find("a.i32")->to_string(), "[7, -8, 9]");
  EXPECT_EQ(f.find("a.i32")->to_string(2), "[7, -8, ... (3 items)]");
  EXPECT_EQ(f.find("a.bool")->to_string(), "[true, false, true]");
  EXPECT_EQ(f.find("a.str")->to_string(), "[\"a\", \"\", \"ccc\"]");
  EXPECT_EQ(f.find("a.nested")->to_string(), "[2 arrays]");
  EXPECT_EQ(f.find("a.empty")->to_string(), "[]");
  EXPECT_EQ(gguf_type_name(GgufType::F64), "f64");
}

TEST(Gguf, GettersRejectWrongTypesNamingTheKey) {
  const auto bytes = all_types_builder(3).build();
  const GgufFile f = GgufFile::parse(bytes, "all.gguf");
  auto expect_names_key = [](auto&& fn, const std::string& key) {
    try {
      fn();
      ADD_FAILURE() << "no error for " << key;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("all.gguf"), std::string::npos) << e.what();
    }
  };
  expect_names_key([&] { (void)f.get_int("t.str"); }, "t.str");
  expect_names_key([&] { (void)f.get_int("t.f32"); }, "t.f32");
  expect_names_key([&] { (void)f.get_float("t.str"); }, "t.str");
  expect_names_key([&] { (void)f.get_string("t.u8"); }, "t.u8");
  expect_names_key([&] { (void)f.get_bool("t.u8"); }, "t.u8");
  expect_names_key([&] { (void)f.get_string_array("a.i32"); }, "a.i32");
  expect_names_key([&] { (void)f.get_string_array("t.str"); }, "t.str");
  expect_names_key([&] { (void)f.get_int_array("a.str"); }, "a.str");
  expect_names_key([&] { (void)f.get_float_array("a.str"); }, "a.str");
  expect_names_key([&] { (void)f.get_float_array("t.f32"); }, "t.f32");

  EXPECT_EQ(f.get_int("missing"), std::nullopt);
  EXPECT_EQ(f.get_float("missing"), std::nullopt);
  EXPECT_EQ(f.get_string("missing"), std::nullopt);
  EXPECT_EQ(f.get_bool("missing"), std::nullopt);
  EXPECT_TRUE(f.get_int_array("missing").empty());
  EXPECT_TRUE(f.get_float_array("missing").empty());
  const auto& a = f.get_string_array("missing");
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(&a, &f.get_string_array("other missing"));  // one static empty vector
  EXPECT_EQ(f.find("missing"), nullptr);
}

std::vector<uint8_t> iota_bytes(size_t n, uint8_t start) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint8_t(start + i);
  return v;
}

class GgufAlignments : public testing::TestWithParam<uint32_t> {};

TEST_P(GgufAlignments, TensorsAndViews) {
  const uint32_t align = GetParam();
  GgufBuilder b;
  if (align != 32) b.alignment_kv(align);
  b.kv_str("general.architecture", "test");
  // Names out of alphabetical order: the reader keeps file order.
  b.tensor({"z.f32", {3, 2}, 0, test::f32_bytes({0, 1, 2, 3, 4, 5}), {}});
  b.tensor({"a.q8", {64, 3}, 8, iota_bytes(3 * 2 * 34, 7), {}});
  b.tensor({"m.f16", {2, 3, 4}, 1, iota_bytes(48, 1), {}});
  b.tensor({"vec.i8", {5}, 24, iota_bytes(5, 100), {}});
  b.tensor({"four.i16", {1, 2, 1, 3}, 25, iota_bytes(12, 50), {}});
  b.tensor({"empty", {0, 4}, 0, {}, {}});
  GgufLayout layout;
  const auto bytes = b.build(&layout);
  const GgufFile f = GgufFile::parse(bytes, "t.gguf");

  EXPECT_EQ(f.alignment(), align);
  EXPECT_EQ(f.data_offset(), layout.data_start);
  EXPECT_EQ(f.data_offset() % align, 0u);
  ASSERT_EQ(f.tensors().size(), 6u);
  const std::vector<std::string> names = {"z.f32", "a.q8", "m.f16", "vec.i8", "four.i16", "empty"};
  for (size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(f.tensors()[i].name, names[i]);
    EXPECT_EQ(f.find_tensor(names[i]), &f.tensors()[i]);
    EXPECT_EQ((f.tensors()[i].offset - f.data_offset()) % align, 0u);
  }
  EXPECT_EQ(f.find_tensor("nope"), nullptr);

  const TensorView z = f.view(*f.find_tensor("z.f32"));
  EXPECT_EQ(z.dtype, DType::F32);
  EXPECT_EQ(z.ndim, 2);
  EXPECT_EQ(z.shape_str(), "[2, 3]");
  EXPECT_EQ(z.stride[0], 12);
  EXPECT_EQ(z.stride[1], 4);
  EXPECT_TRUE(z.is_contiguous());
  EXPECT_EQ(z.nbytes(), 24u);
  EXPECT_EQ(test::load<float>(z.row(1), 2), 5.0f);
  EXPECT_EQ(static_cast<const uint8_t*>(z.data), bytes.data() + f.find_tensor("z.f32")->offset);

  const GgufTensorInfo& q = *f.find_tensor("a.q8");
  EXPECT_EQ(q.dtype, DType::Q8_0);
  EXPECT_EQ(q.dims, (std::vector<int64_t>{64, 3}));
  EXPECT_EQ(q.nbytes, 3u * 2 * 34);
  const TensorView qv = f.view(q);
  EXPECT_EQ(qv.shape_str(), "[3, 64]");
  EXPECT_EQ(qv.stride[0], 68);
  EXPECT_EQ(qv.stride[1], 0);
  EXPECT_EQ(qv.row(2)[0], uint8_t(7 + 2 * 68));

  const TensorView m = f.view(*f.find_tensor("m.f16"));
  EXPECT_EQ(m.shape_str(), "[4, 3, 2]");
  EXPECT_EQ(m.stride[0], 12);
  EXPECT_EQ(m.stride[1], 4);
  EXPECT_EQ(m.stride[2], 2);

  const TensorView v = f.view(*f.find_tensor("vec.i8"));
  EXPECT_EQ(v.shape_str(), "[5]");
  EXPECT_EQ(v.ptr<int8_t>()[4], 104);

  const TensorView four = f.view(*f.find_tensor("four.i16"));
  EXPECT_EQ(four.shape_str(), "[3, 1, 2, 1]");
  EXPECT_EQ(four.nbytes(), 12u);
  EXPECT_EQ(four.stride[0], 4);

  EXPECT_EQ(f.view(*f.find_tensor("empty")).numel(), 0);
}

INSTANTIATE_TEST_SUITE_P(Alignments, GgufAlignments, testing::Values(1u, 8u, 32u, 64u, 4096u));

TEST(Gguf, ZeroTensorsAndNoMetadata) {
  GgufBuilder b;
  auto bytes = b.build();
  bytes.resize(24);  // just the header: with no tensors, the data section may be missing
  const GgufFile f = GgufFile::parse(bytes, "empty.gguf");
  EXPECT_TRUE(f.metadata().empty());
  EXPECT_TRUE(f.tensors().empty());
  EXPECT_EQ(f.alignment(), 32u);
}

TEST(Gguf, ZeroDimTensorIsAScalar) {
  GgufBuilder b;
  b.tensor({"s", {}, 0, test::f32_bytes({3.5f}), {}});
  const auto bytes = b.build();
  const GgufFile f = GgufFile::parse(bytes, "s.gguf");
  const TensorView v = f.view(f.tensors()[0]);
  EXPECT_EQ(v.shape_str(), "[1]");
  EXPECT_EQ(test::load<float>(v.data), 3.5f);
}

TEST(Gguf, OpenMapsTheFile) {
  test::TempDir dir;
  GgufBuilder b;
  b.kv<uint32_t>("llama.block_count", GgufType::U32, 2);
  b.tensor({"w", {4}, 0, test::f32_bytes({1, 2, 3, 4}), {}});
  const auto path = dir.write("m.gguf", b.build());
  const GgufFile f = GgufFile::open(path);
  ASSERT_NE(f.mapping(), nullptr);
  EXPECT_EQ(f.path(), path.string());
  EXPECT_EQ(f.get_int("llama.block_count"), 2);
  EXPECT_EQ(test::load<float>(f.view(f.tensors()[0]).data, 3), 4.0f);
  EXPECT_THROW(GgufFile::open(dir.path() / "missing.gguf"), Error);
}

// A file written by gguf-py (llama.cpp's Python writer), see tools/make_format_fixtures.py.
TEST(Gguf, ReadsFileWrittenByGgufPy) {
  const GgufFile f =
      GgufFile::open(std::string(DS_FIXTURES_DIR) + "/formats/gguf_py_all_types.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.get_string("general.architecture"), "test");
  EXPECT_EQ(f.get_int("t.u8"), 200);
  EXPECT_EQ(f.get_int("t.i8"), -100);
  EXPECT_EQ(f.get_int("t.u16"), 60000);
  EXPECT_EQ(f.get_int("t.i16"), -30000);
  EXPECT_EQ(f.get_int("t.u32"), 4000000000LL);
  EXPECT_EQ(f.get_int("t.i32"), -2000000000);
  EXPECT_EQ(f.get_float("t.f32"), 1.5);
  EXPECT_EQ(f.get_bool("t.bool"), true);
  EXPECT_EQ(f.get_string("t.str"), "h\xc3\xa9llo");
  EXPECT_EQ(std::get<uint64_t>(f.find("t.u64")->value), (uint64_t(1) << 63) + 5);
  EXPECT_EQ(f.get_int("t.i64"), -(int64_t(1) << 62));
  EXPECT_EQ(f.get_float("t.f64"), -2.25e300);
  EXPECT_EQ(f.get_int_array("t.arr_u8"), (std::vector<int64_t>{1, 2, 255}));
  EXPECT_EQ(f.get_int_array("t.arr_i16"), (std::vector<int64_t>{-1, 2, -3}));
  EXPECT_EQ(std::get<std::vector<uint64_t>>(f.find("t.arr_u64")->value),
            (std::vector<uint64_t>{~uint64_t(0), 0}));
  EXPECT_EQ(f.get_float_array("t.arr_f64"), (std::vector<double>{0.5, -1.0}));
  EXPECT_EQ(f.get_int_array("t.arr_i32"), (std::vector<int64_t>{7, -8, 9}));
  EXPECT_EQ(f.get_float_array("t.arr_f32"), (std::vector<double>{0.25, 4.0}));
  EXPECT_EQ(f.get_int_array("t.arr_bool"), (std::vector<int64_t>{1, 0, 1}));
  EXPECT_EQ(f.get_string_array("t.arr_str"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f.find("t.arr_nested")->array_size(), 2u);
  EXPECT_EQ(f.find("t.arr_nested")->array_type, GgufType::Array);

  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.tensors()[0].name, "f32.weight");
  const TensorView w = f.view(f.tensors()[0]);
  EXPECT_EQ(w.shape_str(), "[2, 3]");
  EXPECT_EQ(test::load<float>(w.row(1)), 3.0f);
  const TensorView h = f.view(*f.find_tensor("f16.weight"));
  EXPECT_EQ(h.dtype, DType::F16);
  EXPECT_EQ(fp16_to_f32(test::load<uint16_t>(h.data, 3)), 65504.0f);
  const TensorView q = f.view(*f.find_tensor("q8.weight"));
  EXPECT_EQ(q.dtype, DType::Q8_0);
  EXPECT_EQ(q.shape_str(), "[2, 32]");
  uint16_t scale;
  std::memcpy(&scale, q.row(1), 2);
  EXPECT_EQ(fp16_to_f32(scale), 2.0f);
  EXPECT_EQ(int8_t(q.row(1)[2 + 31]), 15);
  const TensorView i = f.view(*f.find_tensor("i32.t"));
  EXPECT_EQ(i.shape_str(), "[1, 3]");
  EXPECT_EQ(test::load<int32_t>(i.data, 1), -2);
  for (const auto& t : f.tensors()) EXPECT_EQ((t.offset - f.data_offset()) % 64, 0u) << t.name;
}

}  // namespace
}  // namespace ds
