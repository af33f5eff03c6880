// Grouped FP8 GEMM with blockwise scaling over the block consumer's READY BLOCKS (CUTLASS 4.2, SM90a).
//
//   D[rows, N] = (A[rows, K] fp8 e4m3, a_sf[rows, K/128] f32) x (W[e][N, K] fp8 e4m3, w_sf[e][N/128, K/128] f32)^T
//
// for every ready block: block b owns rows [b*block_m, (b+1)*block_m) of A / a_sf / D and expert
// block_expert[b]. The ready blocks are ready_list[ready_hi[lo_index] : ready_hi[hi_index]], read ON THE
// DEVICE by a one-CTA setup kernel that turns them into CUTLASS's grouped problem arrays (runs of
// consecutive block ids of one expert merge into one group, its rows being contiguous); groups past the
// last one get M = 0 (no tiles). Then CUTLASS's SM90 warp-specialized ptr-array grouped GEMM with
// FP8 blockwise scaling (KernelPtrArrayTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise, persistent
// grid, group tile scheduler - no stream-K, no split-K) runs with problem_count = max_items.
//
// Why every row depends only on its own data (the bitwise streamed == batch contract): the K loop runs
// over all of K in a fixed order for every output tile (the group scheduler never splits K), each
// 128-wide K block is multiplied into a zeroed temporary accumulator and promoted into the fp32
// accumulator with that row's scale (ScalePromotionInterval = 4 wgmma k-steps = one scale block), and
// the per-group TMA descriptor has the group's own M: rows past the end of a group are zero-filled by
// TMA, never a neighbour's rows, and their results are not stored. A 2-CTA cluster only changes who
// issues a tile's loads (one multicast TMA for both CTAs instead of two), not the bytes that arrive;
// with a cluster along M a group's tile count is rounded up to the cluster, and the extra tile lies
// past the group's M (all zero-filled, nothing stored). Raster order and swizzle only reorder tiles.
//
// Scale layouts: a_sf is [rows, K/128] row-major = CUTLASS's K-major SFA (Sm90BlockwiseScaleConfig
// with majorSFA = K: stride K/128 along M, 1 along K), w_sf[e] is [N/SfN, K/128] row-major = K-major
// SFB, SfN = 128 (the stored 128x128 scales) or 64 for the 192-wide tiles (CUTLASS wants the tile N
// to be a multiple of the scale granularity; the caller repeats each scale twice, same values). No
// other conversion is needed: the mainloop rebuilds each group's scale layout from (M, N, K) with
// exactly these strides (ScaleConfig::tile_atom_to_shape_SF*), so a group's SFA pointer is
// a_sf + row0 * K/128.
//
// No host synchronisation, no allocation and no host read of device data in sr_gemm_run: every array
// is allocated in sr_gemm_create; the kernel parameters (TMA descriptors of the fixed problem arrays)
// are built on the host once per (max_items, max_ctas) and cached. A run can be captured in a CUDA
// graph. One plan must not run concurrently with itself (its problem arrays and tensormap workspace
// are per plan).
//
// Errors: every entry point returns 0 or a non-zero code and leaves a message for
// sr_gemm_last_error() (thread-local). Device-side problems (a ready range longer than max_items or
// negative, a block id or expert id out of range) are OR-ed into a caller-provided int32 status word
// and, when the plan was created with trap_on_error, stop the kernel with a printf + __trap() (the CUDA
// context then reports an error at the next synchronisation: loud, never a silent wrong result).

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "cutlass/cutlass.h"
#include "cutlass/version.h"
#include "cutlass/numeric_types.h"
#include "cute/tensor.hpp"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#ifndef SR_GEMM_SOURCE_HASH
#define SR_GEMM_SOURCE_HASH "unknown"
#endif

#define SR_API extern "C" __attribute__((visibility("default")))

// The build compiles this file SR_GEMM_NUM_PARTS times, once per part, in parallel (each kernel
// variant is a long compile): part p instantiates the variants v with v % SR_GEMM_NUM_PARTS == p,
// part 0 also holds the C entry points. Compiled alone (no -D), one part holds everything.
#ifndef SR_GEMM_NUM_PARTS
#define SR_GEMM_NUM_PARTS 1
#endif
#ifndef SR_GEMM_PART
#define SR_GEMM_PART 0
#endif
#define SR_GEMM_OWNS(v) ((v) % SR_GEMM_NUM_PARTS == SR_GEMM_PART)

// Status bits written by the setup kernel (mirrored in streamring/device/cutlass_gemm.py).
#define SR_STATUS_RANGE_CLAMPED 1    // ready_hi[hi] - ready_hi[lo] > max_items: blocks past max_items dropped
#define SR_STATUS_RANGE_NEGATIVE 2   // ready_hi[hi] < ready_hi[lo]
#define SR_STATUS_BAD_BLOCK 4        // a ready block id outside [0, num_blocks): item skipped
#define SR_STATUS_BAD_EXPERT 8       // block_expert of a ready block outside [0, num_experts): item skipped
#define SR_STATUS_RANGE_OUTSIDE 16   // ready_hi[lo] < 0 or ready_hi[hi] > ready_len: nothing computed

// Error codes returned by the entry points.
#define SR_OK 0
#define SR_ERR_ARG 1
#define SR_ERR_CUDA 2
#define SR_ERR_CUTLASS 3
#define SR_ERR_DEVICE 4

namespace sr {

using namespace cute;

#if SR_GEMM_PART == 0
thread_local std::string g_last_error;
#else
extern thread_local std::string g_last_error;
#endif

static int fail(int code, std::string const& msg) {
  g_last_error = msg;
  return code;
}

static int cuda_fail(char const* what, cudaError_t err) {
  return fail(SR_ERR_CUDA, std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

#define SR_CUDA(call)                                   \
  do {                                                  \
    cudaError_t _e = (call);                            \
    if (_e != cudaSuccess) return cuda_fail(#call, _e); \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Kernel configurations
// ------------------------------------------------------------------------------------------------
// SfN_: rows of W per weight scale the kernel reads (128: w_sf as stored; 64: each 128-row scale
// repeated twice, for tiles whose N is not a multiple of 128 - CUTLASS wants the tile N to be a
// multiple of the scale granularity N).
template <class TileShape_, class ClusterShape_, class KernelSchedule_, class EpilogueSchedule_, class ElementD_,
          int SfN_ = 128>
struct Config {
  static constexpr int kSfN = SfN_;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;
  using ElementA = cutlass::float_e4m3_t;
  using LayoutA = cutlass::layout::RowMajor;      // A[rows, K], K contiguous
  using ElementB = cutlass::float_e4m3_t;
  using LayoutB = cutlass::layout::ColumnMajor;   // B = W^T as K x N column-major = W[N, K] row-major
  using ElementC = void;                          // no source operand (beta = 0)
  using ElementD = ElementD_;
  using LayoutD = cutlass::layout::RowMajor;      // D[rows, N], N contiguous
  static constexpr int AlignmentA = 128 / cutlass::sizeof_bits<ElementA>::value;
  static constexpr int AlignmentB = 128 / cutlass::sizeof_bits<ElementB>::value;
  static constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using ElementAccumulator = float;
  using ElementCompute = float;

  // 1 x 128 activation scales, SfN x 128 weight scales, both K-major (see the file comment).
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, SfN_, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using UnderlyingProblemShape = typename ProblemShape::UnderlyingProblemShape;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute, ElementC,
      LayoutD*, AlignmentD, ElementD, LayoutD*, AlignmentD, EpilogueSchedule_,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC, ElementCompute>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, AlignmentA,
      ElementB, cute::tuple<LayoutB*, LayoutSFB*>, AlignmentB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::InternalStrideA;
  using StrideB = typename GemmKernel::InternalStrideB;
  using StrideD = typename GemmKernel::InternalStrideD;
  using Params = typename GemmKernel::Params;
  using Arguments = typename Gemm::Arguments;
};

using CoopTile = Shape<_128, _128, _128>;
using PingTile = Shape<_64, _128, _128>;
using Coop = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
using CoopEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
using Ping = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise;
using PingEpi = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;

using Tile192 = Shape<_128, _192, _128>;
using PingTile192 = Shape<_64, _192, _128>;
using ClusterN2 = Shape<_1, _2, _1>;  // the two CTAs of a cluster: neighbours along N, A tile multicast
using ClusterM2 = Shape<_2, _1, _1>;  // neighbours along M (same expert, same N tile): W tile multicast
using Cluster1 = Shape<_1, _1, _1>;

// Variants (streamring/device/cutlass_gemm.py: TILE_TABLE mirrors this table; tests compare the two):
//   0, 1: 128x128 cooperative, cluster 1x2, bf16 / f32 out (CUTLASS example 68's configuration)
//   2, 3: 64x128 ping-pong, cluster 1x1, bf16 / f32 out (example 68 "sparse groups")
//   4: 128x128 cooperative, cluster 2x1 (W multicast), bf16 out
//   5: 128x192 cooperative, cluster 2x1, bf16 out, weight scales repeated to 64 rows
//   6: 128x192 cooperative, cluster 1x2, bf16 out, weight scales repeated to 64 rows
//   7: 64x192 ping-pong, cluster 1x1, bf16 out, weight scales repeated to 64 rows
// Stages: as many as the shared memory left by the epilogue holds (StageCountAutoCarveout).
// Not here: 128x256 cooperative (2x1): with CUTLASS's second (promotion) accumulator a consumer
// warpgroup's 64x256 tile spills (ptxas -v, nvcc 13.0: 168 registers, 780 bytes of spill stores).
using V0 = Config<CoopTile, ClusterN2, Coop, CoopEpi, cutlass::bfloat16_t>;
using V1 = Config<CoopTile, ClusterN2, Coop, CoopEpi, float>;
using V2 = Config<PingTile, Cluster1, Ping, PingEpi, cutlass::bfloat16_t>;
using V3 = Config<PingTile, Cluster1, Ping, PingEpi, float>;
using V4 = Config<CoopTile, ClusterM2, Coop, CoopEpi, cutlass::bfloat16_t>;
using V5 = Config<Tile192, ClusterM2, Coop, CoopEpi, cutlass::bfloat16_t, 64>;
using V6 = Config<Tile192, ClusterN2, Coop, CoopEpi, cutlass::bfloat16_t, 64>;
using V7 = Config<PingTile192, Cluster1, Ping, PingEpi, cutlass::bfloat16_t, 64>;
constexpr int kNumVariants = 8;

// ------------------------------------------------------------------------------------------------
// Ready range -> grouped problem arrays (one CTA; deterministic)
// ------------------------------------------------------------------------------------------------
struct SetupArgs {
  int const* ready_list;
  int ready_len;  // entries of ready_list
  int const* ready_hi;
  int lo_index, hi_index, max_items;
  int const* block_expert;
  int num_blocks, num_experts, block_m;
  int n, k;
  char const* a;       // fp8 [num_blocks * block_m, K]
  char const* a_sf;    // f32 [num_blocks * block_m, K/128]
  char const* w;       // fp8 [E, N, K]
  char const* w_sf;    // f32 [E, N/128, K/128]
  char* d;             // [num_blocks * block_m, N] of ElementD
  int* status;
  int trap_on_error;
};

constexpr int kSetupThreads = 1024;

// Exclusive scan of v over the CTA; *total receives the sum.
static __device__ int block_exclusive_scan(int v, int* total) {  // static: one copy per part, no link clash
  __shared__ int warp_sums[kSetupThreads / 32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < kSetupThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      int y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;  // inclusive prefix of the warp sums
  }
  __syncthreads();
  int before = warp > 0 ? warp_sums[warp - 1] : 0;
  *total = warp_sums[kSetupThreads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before + x - v;
}

template <class Cfg>
struct ProblemArrays {
  typename Cfg::UnderlyingProblemShape* shapes;
  typename Cfg::ElementA const** ptr_a;
  typename Cfg::ElementB const** ptr_b;
  float const** ptr_sfa;
  float const** ptr_sfb;
  typename Cfg::ElementD** ptr_d;
  typename Cfg::StrideA* stride_a;
  typename Cfg::StrideB* stride_b;
  typename Cfg::StrideD* stride_d;
  typename Cfg::LayoutSFA* layout_sfa;
  typename Cfg::LayoutSFB* layout_sfb;
  int* group_first;  // scratch: first item of each group
  int* group_last;   // scratch: last item of each group
};

// Item i of the range is valid when its block id and expert are in range; flags otherwise.
__device__ __forceinline__ bool load_item(SetupArgs const& s, int lo, int i, int* bid, int* e) {
  int b = s.ready_list[lo + i];
  if (b < 0 || b >= s.num_blocks) {
    *bid = b; *e = -1;
    return false;
  }
  int x = s.block_expert[b];
  *bid = b; *e = x;
  return x >= 0 && x < s.num_experts;
}

template <class Cfg>
__global__ void __launch_bounds__(kSetupThreads, 1) setup_groups_kernel(SetupArgs s, ProblemArrays<Cfg> p) {
  __shared__ int s_flags;
  if (threadIdx.x == 0) s_flags = 0;
  __syncthreads();
  int const lo = s.ready_hi[s.lo_index];
  int const hi = s.ready_hi[s.hi_index];
  int n = hi - lo;
  if (n > 0 && (lo < 0 || hi > s.ready_len)) {
    if (threadIdx.x == 0) atomicOr(&s_flags, SR_STATUS_RANGE_OUTSIDE);
    n = 0;
  }
  if (n < 0) {
    if (threadIdx.x == 0) atomicOr(&s_flags, SR_STATUS_RANGE_NEGATIVE);
    n = 0;
  }
  if (n > s.max_items) {
    if (threadIdx.x == 0) atomicOr(&s_flags, SR_STATUS_RANGE_CLAMPED);
    n = s.max_items;
  }
  // pass 1: run starts/ends, group index of each item by a scan of the start flags
  int carry = 0;
  for (int base = 0; base < n; base += kSetupThreads) {
    int i = base + threadIdx.x;
    int start = 0, end = 0;
    if (i < n) {
      int bid, e;
      bool ok = load_item(s, lo, i, &bid, &e);
      if (!ok) atomicOr(&s_flags, (bid < 0 || bid >= s.num_blocks) ? SR_STATUS_BAD_BLOCK : SR_STATUS_BAD_EXPERT);
      if (ok) {
        int pb, pe, nb, ne;
        bool prev_joins = i > 0 && load_item(s, lo, i - 1, &pb, &pe) && pb + 1 == bid && pe == e;
        bool next_joins = i + 1 < n && load_item(s, lo, i + 1, &nb, &ne) && bid + 1 == nb && ne == e;
        start = !prev_joins;
        end = !next_joins;
      }
    }
    int total;
    int before = block_exclusive_scan(start, &total);
    if (i < n) {
      if (start) p.group_first[carry + before] = i;
      // an item that ends a run belongs to the group of the last start at or before it
      if (end) p.group_last[carry + before + start - 1] = i;
    }
    carry += total;
  }
  int const groups = carry;  // <= n <= max_items
  __syncthreads();           // group_first/last written above are read below (same CTA)
  // pass 2: one problem per group, M = 0 past the last group
  int64_t const k = s.k, nn = s.n;
  int64_t const sfk = k / 128;
  for (int g = threadIdx.x; g < s.max_items; g += kSetupThreads) {
    int m = 0;
    int64_t row0 = 0, e = 0;
    if (g < groups) {
      int first = p.group_first[g], last = p.group_last[g];
      int bid = s.ready_list[lo + first];
      e = s.block_expert[bid];
      row0 = int64_t(bid) * s.block_m;
      m = (last - first + 1) * s.block_m;
    }
    p.shapes[g] = make_shape(m, s.n, s.k);
    p.ptr_a[g] = reinterpret_cast<typename Cfg::ElementA const*>(s.a + row0 * k);
    p.ptr_sfa[g] = reinterpret_cast<float const*>(s.a_sf) + row0 * sfk;
    p.ptr_b[g] = reinterpret_cast<typename Cfg::ElementB const*>(s.w + e * nn * k);
    p.ptr_sfb[g] = reinterpret_cast<float const*>(s.w_sf) + e * (nn / Cfg::kSfN) * sfk;
    p.ptr_d[g] = reinterpret_cast<typename Cfg::ElementD*>(s.d + row0 * nn * int64_t(sizeof(typename Cfg::ElementD)));
    p.stride_a[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideA{}, {m, s.k, 1});
    p.stride_b[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideB{}, {s.n, s.k, 1});
    p.stride_d[g] = cutlass::make_cute_packed_stride(typename Cfg::StrideD{}, {m, s.n, 1});
    p.layout_sfa[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, s.n, s.k, 1));
    p.layout_sfb[g] = Cfg::ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, s.n, s.k, 1));
  }
  __syncthreads();
  if (threadIdx.x == 0 && s_flags != 0) {
    atomicOr(s.status, s_flags);
    if (s.trap_on_error) {
      printf("streamring CUTLASS gemm setup: bad ready range (status 0x%x: 1 = longer than max_items=%d, "
             "2 = negative, 4 = block id outside [0,%d), 8 = expert outside [0,%d), 16 = outside the ready list of %d); "
             "ready_hi[%d]=%d ready_hi[%d]=%d\n",
             s_flags, s.max_items, s.num_blocks, s.num_experts, s.ready_len, s.lo_index, lo, s.hi_index, hi);
      __trap();
    }
  }
}

// ------------------------------------------------------------------------------------------------
// Plans
// ------------------------------------------------------------------------------------------------
struct RunArgs {
  int const* ready_list;
  int ready_len;
  int const* ready_hi;
  int lo_index, hi_index, max_items;
  int const* block_expert;
  int num_blocks, num_experts, block_m;
  void const* a;
  float const* a_sf;
  void const* w;
  float const* w_sf;
  void* d;
  int* status;
  int max_ctas;
};

struct PlanBase {
  int variant = -1, n = 0, k = 0, capacity = 0, device = -1, sm_count = 0, trap_on_error = 1;
  int raster = 0;   // the group scheduler's order inside a group: 0 = along M, 1 = along N
  int swizzle = 1;  // its max_swizzle_size (1, 2, 4 or 8)
  virtual ~PlanBase() = default;
  virtual int create() = 0;
  virtual int run(RunArgs const& r, cudaStream_t stream) = 0;
  virtual int setup_only(RunArgs const& r, cudaStream_t stream) = 0;
  virtual int read_groups(int count, int* m_out, int64_t* a_out, int64_t* b_out, int64_t* sfa_out, int64_t* sfb_out,
                          int64_t* d_out) = 0;
};

template <class Cfg>
struct Plan final : PlanBase {
  using Gemm = typename Cfg::Gemm;
  using GemmKernel = typename Cfg::GemmKernel;

  void* arrays = nullptr;     // every problem array, one allocation
  void* workspace = nullptr;  // CUTLASS's (tensormaps per SM)
  size_t workspace_bytes = 0;
  ProblemArrays<Cfg> p{};
  int max_active_clusters = 0;
  std::mutex mu;
  std::map<std::pair<int, int>, typename Cfg::Params> params_cache;  // (max_items, ctas) -> kernel params

  ~Plan() override {
    if (arrays) cudaFree(arrays);
    if (workspace) cudaFree(workspace);
  }

  int create() override {
    SR_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
    int major = 0, minor = 0;
    SR_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    SR_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major != 9 || minor != 0)
      return fail(SR_ERR_DEVICE, "the CUTLASS FP8 blockwise grouped GEMM is built for sm_90a (H100/H200); device " +
                                     std::to_string(device) + " has compute capability " + std::to_string(major) +
                                     "." + std::to_string(minor));
    // one allocation for every per-group array
    size_t off = 0;
    size_t offs[13];
    auto take = [&](int idx, size_t bytes) {
      off = (off + 127) / 128 * 128;
      offs[idx] = off;
      off += bytes;
    };
    size_t c = size_t(capacity);
    take(0, c * sizeof(typename Cfg::UnderlyingProblemShape));
    take(1, c * sizeof(void*));
    take(2, c * sizeof(void*));
    take(3, c * sizeof(void*));
    take(4, c * sizeof(void*));
    take(5, c * sizeof(void*));
    take(6, c * sizeof(typename Cfg::StrideA));
    take(7, c * sizeof(typename Cfg::StrideB));
    take(8, c * sizeof(typename Cfg::StrideD));
    take(9, c * sizeof(typename Cfg::LayoutSFA));
    take(10, c * sizeof(typename Cfg::LayoutSFB));
    take(11, c * sizeof(int));
    take(12, c * sizeof(int));
    SR_CUDA(cudaMalloc(&arrays, off));
    SR_CUDA(cudaMemset(arrays, 0, off));
    char* base = static_cast<char*>(arrays);
    p.shapes = reinterpret_cast<typename Cfg::UnderlyingProblemShape*>(base + offs[0]);
    p.ptr_a = reinterpret_cast<typename Cfg::ElementA const**>(base + offs[1]);
    p.ptr_b = reinterpret_cast<typename Cfg::ElementB const**>(base + offs[2]);
    p.ptr_sfa = reinterpret_cast<float const**>(base + offs[3]);
    p.ptr_sfb = reinterpret_cast<float const**>(base + offs[4]);
    p.ptr_d = reinterpret_cast<typename Cfg::ElementD**>(base + offs[5]);
    p.stride_a = reinterpret_cast<typename Cfg::StrideA*>(base + offs[6]);
    p.stride_b = reinterpret_cast<typename Cfg::StrideB*>(base + offs[7]);
    p.stride_d = reinterpret_cast<typename Cfg::StrideD*>(base + offs[8]);
    p.layout_sfa = reinterpret_cast<typename Cfg::LayoutSFA*>(base + offs[9]);
    p.layout_sfb = reinterpret_cast<typename Cfg::LayoutSFB*>(base + offs[10]);
    p.group_first = reinterpret_cast<int*>(base + offs[11]);
    p.group_last = reinterpret_cast<int*>(base + offs[12]);

    // shared memory above 48 KB must be opted into, once per kernel (not during a capture)
    int smem = GemmKernel::SharedStorageSize;
    SR_CUDA(cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    max_active_clusters = cutlass::KernelHardwareInfo::query_device_max_active_clusters<GemmKernel>();
    if (max_active_clusters <= 0) {
      cudaError_t e = cudaGetLastError();
      return fail(SR_ERR_CUDA, std::string("cudaOccupancyMaxActiveClusters found no cluster of this kernel fits "
                                           "on the device (shared memory ") + std::to_string(smem) + " B): " +
                                   cudaGetErrorString(e));
    }
    auto args = arguments(capacity, sm_count);
    workspace_bytes = Gemm::get_workspace_size(args);
    if (workspace_bytes > 0) SR_CUDA(cudaMalloc(&workspace, workspace_bytes));
    cutlass::Status st = Gemm::can_implement(args);
    if (st != cutlass::Status::kSuccess)
      return fail(SR_ERR_CUTLASS, std::string("CUTLASS can_implement refused the grouped GEMM: ") +
                                      cutlass::cutlassGetStatusString(st));
    return SR_OK;
  }

  typename Cfg::Arguments arguments(int problem_count, int ctas) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = ctas;
    // CUTLASS sizes the persistent grid as max_active_clusters clusters: at most what fits on the
    // device, at most ctas CTAs (a smaller grid leaves SMs to other streams, like the Triton path's max_ctas)
    int cluster_size = size(typename Cfg::ClusterShape{});
    hw.max_active_clusters = std::max(1, std::min(max_active_clusters, ctas / cluster_size));
    typename Cfg::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {problem_count, p.shapes, nullptr},  // no host problem shapes: the device arrays are the truth
        {p.ptr_a, p.stride_a, p.ptr_b, p.stride_b, p.ptr_sfa, p.layout_sfa, p.ptr_sfb, p.layout_sfb},
        {{}, nullptr, p.stride_d, p.ptr_d, p.stride_d},
        hw};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 1.0f;  // exact: D = round(acc)
    fusion.beta = 0.0f;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = nullptr;
    fusion.beta_ptr_array = nullptr;
    // The group scheduler hands out tiles group by group (the groups are the ready runs of one
    // expert, in ready-list order); inside a group, along M (default: consecutive CTAs share each
    // weight tile through L2) or along N (they share the activation rows), in swizzle-wide strips.
    args.scheduler.raster_order = raster == 1 ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN
                                              : cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
    args.scheduler.max_swizzle_size = swizzle;
    return args;
  }

  int params_for(int max_items, int ctas, typename Cfg::Params** out) {
    std::lock_guard<std::mutex> lock(mu);
    auto key = std::make_pair(max_items, ctas);
    auto it = params_cache.find(key);
    if (it == params_cache.end()) {
      auto args = arguments(max_items, ctas);
      cutlass::Status st = Gemm::can_implement(args);
      if (st != cutlass::Status::kSuccess)
        return fail(SR_ERR_CUTLASS, std::string("CUTLASS can_implement refused: ") + cutlass::cutlassGetStatusString(st));
      if (Gemm::get_workspace_size(args) > workspace_bytes)
        return fail(SR_ERR_CUTLASS, "CUTLASS workspace grew past the one allocated at create");
      it = params_cache.emplace(key, GemmKernel::to_underlying_arguments(args, workspace)).first;
    }
    *out = &it->second;
    return SR_OK;
  }

  int launch_setup(RunArgs const& r, cudaStream_t stream) {
    SetupArgs s{r.ready_list, r.ready_len, r.ready_hi, r.lo_index, r.hi_index, r.max_items, r.block_expert, r.num_blocks,
                r.num_experts, r.block_m, n, k, static_cast<char const*>(r.a),
                reinterpret_cast<char const*>(r.a_sf), static_cast<char const*>(r.w),
                reinterpret_cast<char const*>(r.w_sf), static_cast<char*>(r.d), r.status, trap_on_error};
    setup_groups_kernel<Cfg><<<1, kSetupThreads, 0, stream>>>(s, p);
    SR_CUDA(cudaGetLastError());
    return SR_OK;
  }

  int check_device() {
    int cur = -1;
    SR_CUDA(cudaGetDevice(&cur));
    if (cur != device)
      return fail(SR_ERR_ARG, "the current CUDA device is " + std::to_string(cur) + " but this plan was created on device " +
                                  std::to_string(device));
    return SR_OK;
  }

  int check_run(RunArgs const& r) {
    if (r.max_items < 0 || r.max_items > capacity)
      return fail(SR_ERR_ARG, "max_items=" + std::to_string(r.max_items) + " outside [0, capacity=" +
                                  std::to_string(capacity) + "] of this plan");
    if (r.block_m <= 0 || r.num_blocks <= 0 || r.num_experts <= 0 || r.ready_len < 0)
      return fail(SR_ERR_ARG, "block_m, num_blocks and num_experts must be positive, ready_len non-negative");
    if (!r.ready_list || !r.ready_hi || !r.block_expert || !r.a || !r.a_sf || !r.w || !r.w_sf || !r.d || !r.status)
      return fail(SR_ERR_ARG, "a device pointer argument is null");
    if (r.lo_index < 0 || r.hi_index < 0) return fail(SR_ERR_ARG, "lo_index and hi_index must be >= 0");
    if ((reinterpret_cast<uintptr_t>(r.a) | reinterpret_cast<uintptr_t>(r.w) | reinterpret_cast<uintptr_t>(r.d)) & 15)
      return fail(SR_ERR_ARG, "a, w and d must be 16-byte aligned (TMA)");
    if ((reinterpret_cast<uintptr_t>(r.a_sf) | reinterpret_cast<uintptr_t>(r.w_sf)) & 3)
      return fail(SR_ERR_ARG, "a_sf and w_sf must be 4-byte aligned");
    return check_device();
  }

  int run(RunArgs const& r, cudaStream_t stream) override {
    int rc = check_run(r);
    if (rc) return rc;
    if (r.max_items == 0) return SR_OK;  // nothing can be ready (the Triton launchers return too)
    // persistent grid size: the device, or max_ctas rounded down to whole clusters (at least one);
    // the tensormap workspace is indexed by CTA and sized for the device, so any such grid fits
    int const cluster_size = size(typename Cfg::ClusterShape{});
    int ctas = r.max_ctas > 0 && r.max_ctas < sm_count ? r.max_ctas : sm_count;
    ctas = std::max(cluster_size, ctas / cluster_size * cluster_size);
    typename Cfg::Params* params = nullptr;
    rc = params_for(r.max_items, ctas, &params);
    if (rc) return rc;
    rc = launch_setup(r, stream);
    if (rc) return rc;
    cutlass::Status st = Gemm::run(*params, stream);
    if (st != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      return fail(SR_ERR_CUTLASS, std::string("CUTLASS grouped GEMM launch failed: ") + cutlass::cutlassGetStatusString(st) +
                                      " / " + cudaGetErrorString(e));
    }
    SR_CUDA(cudaGetLastError());
    return SR_OK;
  }

  int setup_only(RunArgs const& r, cudaStream_t stream) override {
    int rc = check_run(r);
    if (rc) return rc;
    if (r.max_items == 0) return SR_OK;
    return launch_setup(r, stream);
  }

  int read_groups(int count, int* m_out, int64_t* a_out, int64_t* b_out, int64_t* sfa_out, int64_t* sfb_out,
                  int64_t* d_out) override {
    if (count < 0 || count > capacity) return fail(SR_ERR_ARG, "count outside [0, capacity]");
    int rc = check_device();
    if (rc) return rc;
    SR_CUDA(cudaDeviceSynchronize());
    for (int g = 0; g < count; ++g) {
      typename Cfg::UnderlyingProblemShape shape;
      void* ptrs[5];
      SR_CUDA(cudaMemcpy(&shape, p.shapes + g, sizeof(shape), cudaMemcpyDeviceToHost));
      SR_CUDA(cudaMemcpy(&ptrs[0], p.ptr_a + g, sizeof(void*), cudaMemcpyDeviceToHost));
      SR_CUDA(cudaMemcpy(&ptrs[1], p.ptr_b + g, sizeof(void*), cudaMemcpyDeviceToHost));
      SR_CUDA(cudaMemcpy(&ptrs[2], p.ptr_sfa + g, sizeof(void*), cudaMemcpyDeviceToHost));
      SR_CUDA(cudaMemcpy(&ptrs[3], p.ptr_sfb + g, sizeof(void*), cudaMemcpyDeviceToHost));
      SR_CUDA(cudaMemcpy(&ptrs[4], p.ptr_d + g, sizeof(void*), cudaMemcpyDeviceToHost));
      m_out[g] = get<0>(shape);
      a_out[g] = reinterpret_cast<int64_t>(ptrs[0]);
      b_out[g] = reinterpret_cast<int64_t>(ptrs[1]);
      sfa_out[g] = reinterpret_cast<int64_t>(ptrs[2]);
      sfb_out[g] = reinterpret_cast<int64_t>(ptrs[3]);
      d_out[g] = reinterpret_cast<int64_t>(ptrs[4]);
    }
    return SR_OK;
  }
};

template <class Cfg>
struct VariantInfo {
  static void fill(int* out) {
    out[0] = size<0>(typename Cfg::TileShape{});
    out[1] = size<1>(typename Cfg::TileShape{});
    out[2] = size<2>(typename Cfg::TileShape{});
    out[3] = size<0>(typename Cfg::ClusterShape{});
    out[4] = size<1>(typename Cfg::ClusterShape{});
    out[5] = Cfg::GemmKernel::SharedStorageSize;
    out[6] = Cfg::GemmKernel::MaxThreadsPerBlock;
    out[7] = int(sizeof(typename Cfg::ElementD));
    out[8] = Cfg::CollectiveMainloop::DispatchPolicy::Stages;
    out[9] = Cfg::kSfN;
  }
};

// Per variant: a new plan, and its description. Declared in every part, defined in the part that
// compiles the variant.
#define SR_VARIANT_DECL(i) \
  PlanBase* new_plan_##i(); \
  void variant_info_##i(int* out);
#define SR_VARIANT_DEF(i) \
  PlanBase* new_plan_##i() { return new Plan<V##i>(); } \
  void variant_info_##i(int* out) { VariantInfo<V##i>::fill(out); }
SR_VARIANT_DECL(0)
SR_VARIANT_DECL(1)
SR_VARIANT_DECL(2)
SR_VARIANT_DECL(3)
SR_VARIANT_DECL(4)
SR_VARIANT_DECL(5)
SR_VARIANT_DECL(6)
SR_VARIANT_DECL(7)
#if SR_GEMM_OWNS(0)
SR_VARIANT_DEF(0)
#endif
#if SR_GEMM_OWNS(1)
SR_VARIANT_DEF(1)
#endif
#if SR_GEMM_OWNS(2)
SR_VARIANT_DEF(2)
#endif
#if SR_GEMM_OWNS(3)
SR_VARIANT_DEF(3)
#endif
#if SR_GEMM_OWNS(4)
SR_VARIANT_DEF(4)
#endif
#if SR_GEMM_OWNS(5)
SR_VARIANT_DEF(5)
#endif
#if SR_GEMM_OWNS(6)
SR_VARIANT_DEF(6)
#endif
#if SR_GEMM_OWNS(7)
SR_VARIANT_DEF(7)
#endif

#if SR_GEMM_PART == 0
// nullptr for an unknown variant
static PlanBase* new_plan(int variant) {
  switch (variant) {
    case 0: return new_plan_0();
    case 1: return new_plan_1();
    case 2: return new_plan_2();
    case 3: return new_plan_3();
    case 4: return new_plan_4();
    case 5: return new_plan_5();
    case 6: return new_plan_6();
    case 7: return new_plan_7();
    default: return nullptr;
  }
}

static bool variant_info(int variant, int* out) {
  switch (variant) {
    case 0: variant_info_0(out); return true;
    case 1: variant_info_1(out); return true;
    case 2: variant_info_2(out); return true;
    case 3: variant_info_3(out); return true;
    case 4: variant_info_4(out); return true;
    case 5: variant_info_5(out); return true;
    case 6: variant_info_6(out); return true;
    case 7: variant_info_7(out); return true;
    default: return false;
  }
}

static int bad_variant(int variant) {
  return fail(SR_ERR_ARG, "variant " + std::to_string(variant) + " outside [0, " + std::to_string(kNumVariants) + ")");
}
#endif

}  // namespace sr

#if SR_GEMM_PART == 0

// ------------------------------------------------------------------------------------------------
// C entry points (ctypes: streamring/device/cutlass_gemm.py mirrors these signatures)
// ------------------------------------------------------------------------------------------------
SR_API char const* sr_gemm_last_error(void) { return sr::g_last_error.c_str(); }

SR_API char const* sr_gemm_build_info(void) {
  static std::string info = std::string("source_sha256=") + SR_GEMM_SOURCE_HASH + " cutlass=" +
                            std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
                            std::to_string(CUTLASS_PATCH) + " nvcc=" + std::to_string(__CUDACC_VER_MAJOR__) + "." +
                            std::to_string(__CUDACC_VER_MINOR__) + " variants=" + std::to_string(sr::kNumVariants);
  return info.c_str();
}

SR_API int sr_gemm_num_variants(void) { return sr::kNumVariants; }

// out[10]: tile M, N, K, cluster M, N, shared memory bytes, threads per CTA, bytes per output element, stages,
// rows of W per weight scale the kernel reads (128, or 64: w_sf repeated twice along N)
SR_API int sr_gemm_variant_info(int variant, int* out) {
  if (!out) return sr::fail(SR_ERR_ARG, "out is null");
  return sr::variant_info(variant, out) ? SR_OK : sr::bad_variant(variant);
}

// raster: 0 = tiles of a group along M first, 1 = along N first; swizzle: 1, 2, 4 or 8 (CUTLASS's
// max_swizzle_size). Neither changes what a row computes (every tile runs its whole K loop alone).
SR_API int sr_gemm_create(int variant, int n, int k, int capacity, int device, int trap_on_error, int raster,
                          int swizzle, void** plan_out) {
  sr::g_last_error.clear();
  if (!plan_out) return sr::fail(SR_ERR_ARG, "plan_out is null");
  *plan_out = nullptr;
  if (n <= 0 || k <= 0 || n % 128 || k % 128)
    return sr::fail(SR_ERR_ARG, "n and k must be positive multiples of 128 (the scale blocks), got n=" + std::to_string(n) +
                                    " k=" + std::to_string(k));
  if (capacity <= 0) return sr::fail(SR_ERR_ARG, "capacity must be positive, got " + std::to_string(capacity));
  if (raster != 0 && raster != 1) return sr::fail(SR_ERR_ARG, "raster must be 0 (along M) or 1 (along N), got " + std::to_string(raster));
  if (swizzle != 1 && swizzle != 2 && swizzle != 4 && swizzle != 8)
    return sr::fail(SR_ERR_ARG, "swizzle must be 1, 2, 4 or 8, got " + std::to_string(swizzle));
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return sr::cuda_fail("cudaGetDeviceCount", e);
  if (device < 0 || device >= count)
    return sr::fail(SR_ERR_ARG, "device " + std::to_string(device) + " outside [0, " + std::to_string(count) + ")");
  int cur = -1;
  e = cudaGetDevice(&cur);
  if (e != cudaSuccess) return sr::cuda_fail("cudaGetDevice", e);
  if (cur != device)
    return sr::fail(SR_ERR_ARG, "create the plan with its device current (current " + std::to_string(cur) + ", asked " +
                                    std::to_string(device) + ")");
  std::unique_ptr<sr::PlanBase> plan(sr::new_plan(variant));
  if (!plan) return sr::bad_variant(variant);
  plan->variant = variant;
  plan->n = n;
  plan->k = k;
  plan->capacity = capacity;
  plan->device = device;
  plan->trap_on_error = trap_on_error ? 1 : 0;
  plan->raster = raster;
  plan->swizzle = swizzle;
  int rc = plan->create();
  if (rc) return rc;
  *plan_out = plan.release();
  return SR_OK;
}

SR_API int sr_gemm_destroy(void* plan) {
  delete static_cast<sr::PlanBase*>(plan);
  return SR_OK;
}

#define SR_RUN_STRUCT                                                                                         \
  sr::RunArgs r{ready_list, ready_len, ready_hi, lo_index, hi_index, max_items, block_expert, num_blocks, num_experts,    \
                block_m, a, a_sf, w, w_sf, d, status, max_ctas};

// Setup kernel + grouped GEMM on `stream` (a cudaStream_t; 0 = legacy default stream).
SR_API int sr_gemm_run(void* plan, int const* ready_list, int ready_len, int const* ready_hi, int lo_index, int hi_index,
                      int max_items, int const* block_expert, int num_blocks, int num_experts, int block_m,
                      void const* a, float const* a_sf, void const* w, float const* w_sf, void* d, int* status,
                      int max_ctas, void* stream) {
  if (!plan) return sr::fail(SR_ERR_ARG, "plan is null");
  SR_RUN_STRUCT
  return static_cast<sr::PlanBase*>(plan)->run(r, static_cast<cudaStream_t>(stream));
}

// The setup kernel alone (tests read the problem arrays back with sr_gemm_read_groups).
SR_API int sr_gemm_setup_only(void* plan, int const* ready_list, int ready_len, int const* ready_hi, int lo_index, int hi_index,
                             int max_items, int const* block_expert, int num_blocks, int num_experts, int block_m,
                             void const* a, float const* a_sf, void const* w, float const* w_sf, void* d, int* status,
                             int max_ctas, void* stream) {
  if (!plan) return sr::fail(SR_ERR_ARG, "plan is null");
  SR_RUN_STRUCT
  return static_cast<sr::PlanBase*>(plan)->setup_only(r, static_cast<cudaStream_t>(stream));
}

// Synchronises the device, then copies groups [0, count) of the problem arrays to the host.
SR_API int sr_gemm_read_groups(void* plan, int count, int* m_out, int64_t* a_out, int64_t* b_out, int64_t* sfa_out,
                               int64_t* sfb_out, int64_t* d_out) {
  if (!plan) return sr::fail(SR_ERR_ARG, "plan is null");
  if (count > 0 && (!m_out || !a_out || !b_out || !sfa_out || !sfb_out || !d_out))
    return sr::fail(SR_ERR_ARG, "an output array is null");
  return static_cast<sr::PlanBase*>(plan)->read_groups(count, m_out, a_out, b_out, sfa_out, sfb_out, d_out);
}
#endif  // SR_GEMM_PART == 0
