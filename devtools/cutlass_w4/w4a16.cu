// A candidate for issue 70, measured by scripts/bench-candidates --cutlass-lib: CUTLASS 3's Hopper
// mixed-input GEMM (its example 55's kernel, int4 x bf16 with a bf16 scale per group) behind a C
// ABI, so Python loads it with ctypes and no torch headers (no coupling to a torch version).
//
//   y[m, n] = sum_k x[m, k] * s[k / g, n] * w[n, k]
//
// x bf16 [m, k] row-major; w int4 two's complement [n, k] (k-major, two a byte, the even k in the
// low nibble), reordered once by w4a16_reorder into the layout the kernel reads; s bf16 [k / g, n];
// y bf16 [m, n]. The operands are swapped (the weight is the kernel's A) as the example does, so
// the rows of x are the tile's narrow side. Variants differ in that side and the tile scheduler.
// Build: devtools/cutlass_w4/build (nvcc, CUTLASS's headers; no GPU needed to build).

#include <cstdint>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass/util/mixed_dtype_utils.hpp"

using namespace cute;

namespace {

using MmaType = cutlass::bfloat16_t;
using QuantType = cutlass::int4b_t;
constexpr int TileK = 128 * 8 / sizeof_bits<MmaType>::value;  // 64
using LayoutA = cutlass::layout::RowMajor;     // x
using LayoutB = cutlass::layout::ColumnMajor;  // w as [k, n]
constexpr int AlignA = 128 / sizeof_bits<MmaType>::value;
constexpr int AlignB = 128 / sizeof_bits<QuantType>::value;
using LayoutA_T = typename cutlass::layout::LayoutTranspose<LayoutA>::type;
using StrideA = cutlass::detail::TagToStrideA_t<LayoutA>;
using StrideB = cutlass::detail::TagToStrideB_t<LayoutB>;
using ValueShuffle = Layout<Shape<_2, _4>, Stride<_4, _1>>;
using LayoutAtomQuant = decltype(cutlass::compute_memory_reordering_atom<MmaType, Layout<Shape<_1, _1>>, ValueShuffle>());
using LayoutB_Reordered = decltype(cute::tile_to_shape(LayoutAtomQuant{}, Layout<Shape<int, int, int>, StrideB>{}));
using LayoutC_T = typename cutlass::layout::LayoutTranspose<cutlass::layout::RowMajor>::type;
constexpr int AlignC = 128 / sizeof_bits<MmaType>::value;

template <int RowsTile, class Scheduler>
struct Kernel {
  using TileShape = Shape<_128, Int<RowsTile>, Int<TileK>>;
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      MmaType, LayoutC_T, AlignC, MmaType, LayoutC_T, AlignC,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<QuantType, MmaType>, LayoutB_Reordered, AlignB,
      MmaType, LayoutA_T, AlignA, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue, Scheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  static typename Gemm::Arguments arguments(const void* x, const void* w, const void* s, void* y, int m, int n,
                                            int k, int g) {
    auto stride_a = cutlass::make_cute_packed_stride(StrideA{}, cute::make_shape(m, k, 1));
    auto layout_b = cute::tile_to_shape(LayoutAtomQuant{}, cute::make_shape(n, k, 1));
    using StrideS = typename Mainloop::StrideScale;
    auto stride_s = cutlass::make_cute_packed_stride(StrideS{}, cute::make_shape(n, k / g, 1));
    using StrideC = typename GemmKernel::StrideC;
    auto stride_c = cutlass::make_cute_packed_stride(StrideC{}, cute::make_shape(n, m, 1));
    return typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {n, m, k, 1},
        {static_cast<const QuantType*>(w), layout_b, static_cast<const MmaType*>(x), stride_a,
         static_cast<const MmaType*>(s), stride_s, g},
        {{1.0f, 0.0f}, static_cast<const MmaType*>(y), stride_c, static_cast<MmaType*>(y), stride_c}};
  }

  static size_t workspace(int m, int n, int k, int g) {
    return Gemm::get_workspace_size(arguments(nullptr, nullptr, nullptr, nullptr, m, n, k, g));
  }

  static int run(const void* x, const void* w, const void* s, void* y, int m, int n, int k, int g, void* ws,
                 cudaStream_t stream) {
    Gemm gemm;
    auto args = arguments(x, w, s, y, m, n, k, g);
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
    if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) return 2;
    if (gemm.run(stream) != cutlass::Status::kSuccess) return 3;
    return 0;
  }
};

using Wide = Kernel<128, void>;                                 // the example's tile
using Narrow = Kernel<32, void>;                                // rows of x in 32s
using NarrowSplit = Kernel<32, cutlass::gemm::StreamKScheduler>;  // and K split across the SMs
using Thin = Kernel<16, cutlass::gemm::StreamKScheduler>;         // rows in 16s, K split

template <class K>
size_t workspace_of(int m, int n, int k, int g) { return K::workspace(m, n, k, g); }

}  // namespace

extern "C" {

// the variants, by number: 0 Wide, 1 Narrow, 2 NarrowSplit, 3 Thin
int w4a16_variants() { return 4; }

size_t w4a16_workspace(int variant, int m, int n, int k, int g) {
  switch (variant) {
    case 0: return workspace_of<Wide>(m, n, k, g);
    case 1: return workspace_of<Narrow>(m, n, k, g);
    case 2: return workspace_of<NarrowSplit>(m, n, k, g);
    case 3: return workspace_of<Thin>(m, n, k, g);
  }
  return 0;
}

int w4a16_gemm(int variant, const void* x, const void* w, const void* s, void* y, int m, int n, int k, int g,
               void* workspace, cudaStream_t stream) {
  switch (variant) {
    case 0: return Wide::run(x, w, s, y, m, n, k, g, workspace, stream);
    case 1: return Narrow::run(x, w, s, y, m, n, k, g, workspace, stream);
    case 2: return NarrowSplit::run(x, w, s, y, m, n, k, g, workspace, stream);
    case 3: return Thin::run(x, w, s, y, m, n, k, g, workspace, stream);
  }
  return 4;
}

// w [n, k] int4 in place into the kernel's layout (the same for every variant)
int w4a16_reorder(void* w, int n, int k, cudaStream_t stream) {
  auto shape = cute::make_shape(n, k, 1);
  auto layout = make_layout(shape, cutlass::make_cute_packed_stride(StrideB{}, shape));
  auto reordered = cute::tile_to_shape(LayoutAtomQuant{}, shape);
  cutlass::reorder_tensor(static_cast<QuantType*>(w), layout, reordered);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
