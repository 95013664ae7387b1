#include "backend/backend.h"

namespace ds {

std::string_view op_name(Op op) {
  switch (op) {
    case Op::Embed:
      return "embed";
    case Op::RmsNorm:
      return "rms_norm";
    case Op::MatMul:
      return "matmul";
    case Op::Rope:
      return "rope";
    case Op::StoreKv:
      return "store_kv";
    case Op::Attention:
      return "attention";
    case Op::SiluMul:
      return "silu_mul";
    case Op::Add:
      return "add";
  }
  return "?";
}

}  // namespace ds
