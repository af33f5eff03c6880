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
// The pair variants (8-13, "Pair variants" below) take the same ready range with a non-grouped
// kernel: one 128-row block per tile, the expert as the batch coordinate of one TMA descriptor.
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
#include <vector>

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

// Status bits written by the setup kernel (mirrored in streamring/gemm/cutlass.py).
#define SR_STATUS_RANGE_CLAMPED 1    // ready_hi[hi] - ready_hi[lo] > max_items: blocks past max_items dropped
#define SR_STATUS_RANGE_NEGATIVE 2   // ready_hi[hi] < ready_hi[lo]
#define SR_STATUS_BAD_BLOCK 4        // a ready block id outside [0, num_blocks): item skipped
#define SR_STATUS_BAD_EXPERT 8       // block_expert of a ready block outside [0, num_experts): item skipped
#define SR_STATUS_RANGE_OUTSIDE 16   // ready_hi[lo] < 0 or ready_hi[hi] > ready_len: nothing computed
#define SR_STATUS_DUPLICATE_BLOCK 64 // pair variants: a block id twice in the range with different partners: nothing computed

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
// 1 x 128 activation scales, SfN x 128 weight scales, both K-major (see the file comment): the scale
// layout of every variant, grouped and pair.
template <int SfN>
using BlockwiseScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, SfN, 128, cute::GMMA::Major::K,
                                                                       cute::GMMA::Major::K>;

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

  using ScaleConfig = BlockwiseScaleConfig<SfN_>;
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

// Variants (streamring/gemm/cutlass.py: TILE_TABLE mirrors this table; tests compare the two):
//   0, 1: 128x128 cooperative, cluster 1x2, bf16 / f32 out (CUTLASS example 68's configuration)
//   2, 3: 64x128 ping-pong, cluster 1x1, bf16 / f32 out (example 68 "sparse groups")
//   4: 128x128 cooperative, cluster 2x1 (W multicast), bf16 out
//   5: 128x192 cooperative, cluster 2x1, bf16 out, weight scales repeated to 64 rows
//   6: 128x192 cooperative, cluster 1x2, bf16 out, weight scales repeated to 64 rows
//   7: 64x192 ping-pong, cluster 1x1, bf16 out, weight scales repeated to 64 rows
//   8: pair 128x128 cooperative, cluster 2x1, bf16 out: one 128-row block per tile, the weight tile
//      multicast when the cluster's two blocks are one expert's (PairConfig, below; block_m 128 only)
//   9: pair 128x192, as 8, weight scales repeated to 64 rows
//   10: block 128x128: the pair layout and order with a 1x1 cluster (one block per CTA, no multicast)
//   11: block 128x128 with a 1x2 cluster: two N tiles of one block, the A tile multicast
//   12: pair 128x128 with a 2x2 cluster: variant 8's pairs by two N tiles, the A and the weight tile both shared
//   13: block 64x128 ping-pong, 1x1: a block's two 64-row tiles, one consumer warpgroup's epilogue beside the other's mainloop
// Not here: a 128x192 block tile with the 1x2 cluster (CuTe's "Stride Divisibility Condition" fails in
// this non-grouped collective, CUTLASS 4.2).
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
constexpr int kNumVariants = 14;
// The most CTAs per SM a run's grid may have (max_ctas above the SM count: an oversubscribed grid that runs in
// waves); the grouped plans' tensormap workspace (a slot per CTA, a few hundred bytes) is sized for it.
constexpr int kMaxCtasPerSm = 16;

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

// How many items of the range [lo, hi) of the ready list a setup kernel takes: 0 for a range outside
// the list or negative, at most max_items; thread 0 ORs what was wrong into *flags (shared memory).
static __device__ int ready_item_count(SetupArgs const& s, int lo, int hi, int* flags) {
  int n = hi - lo;
  int bits = 0;
  if (n > 0 && (lo < 0 || hi > s.ready_len)) {
    bits |= SR_STATUS_RANGE_OUTSIDE;
    n = 0;
  }
  if (n < 0) {
    bits |= SR_STATUS_RANGE_NEGATIVE;
    n = 0;
  }
  if (n > s.max_items) {
    bits |= SR_STATUS_RANGE_CLAMPED;
    n = s.max_items;
  }
  if (threadIdx.x == 0 && bits) atomicOr(flags, bits);
  return n;
}

// Thread 0 of a setup kernel: OR flags into the caller's status word and, with trap_on_error, say
// what was wrong and trap (the next synchronisation fails: loud, never a silent wrong result).
static __device__ void report_setup_flags(SetupArgs const& s, int flags, int lo, int hi) {
  if (flags == 0) return;
  atomicOr(s.status, flags);
  if (s.trap_on_error) {
    printf("streamring CUTLASS gemm setup: bad ready range (status 0x%x: 1 = longer than max_items=%d, "
           "2 = negative, 4 = block id outside [0,%d), 8 = expert outside [0,%d), 16 = outside the ready list of %d, "
           "64 = a block id twice with two partners); ready_hi[%d]=%d ready_hi[%d]=%d\n",
           flags, s.max_items, s.num_blocks, s.num_experts, s.ready_len, s.lo_index, lo, s.hi_index, hi);
    __trap();
  }
}

template <class Cfg>
__global__ void __launch_bounds__(kSetupThreads, 1) setup_groups_kernel(SetupArgs s, ProblemArrays<Cfg> p) {
  __shared__ int s_flags;
  if (threadIdx.x == 0) s_flags = 0;
  __syncthreads();
  int const lo = s.ready_hi[s.lo_index];
  int const hi = s.ready_hi[s.hi_index];
  int const n = ready_item_count(s, lo, hi, &s_flags);
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
  if (threadIdx.x == 0) report_setup_flags(s, s_flags, lo, hi);
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

// What every plan does the same way; a plan kind (Plan: grouped, PairPlan: one block per tile)
// supplies its arrays, argument checks, setup kernel and kernel parameters.
struct PlanBase {
  int variant = -1, n = 0, k = 0, capacity = 0, device = -1, sm_count = 0, trap_on_error = 1;
  int raster = 0;   // the tile order: 0 = along M, 1 = along N
  int swizzle = 1;  // the grouped scheduler's max_swizzle_size, a pair plan's band (1, 2, 4 or 8)
  int max_active_clusters = 0;
  virtual ~PlanBase() = default;
  // The clusters of a grid of ctas CTAs: within one wave at most what fits on the device at once
  // (max_active_clusters); an oversubscribed grid (ctas above the SMs) launches all of them, in waves.
  int grid_clusters(int ctas, int cluster) const {
    return ctas > sm_count ? ctas / cluster : std::max(1, std::min(max_active_clusters, ctas / cluster));
  }
  virtual int create() = 0;
  virtual int read_groups(int count, int* m_out, int64_t* a_out, int64_t* b_out, int64_t* sfa_out, int64_t* sfb_out,
                          int64_t* d_out) = 0;
  virtual int check_run(RunArgs const& r) = 0;
  virtual int launch_setup(RunArgs const& r, cudaStream_t stream) = 0;
  // the kernel's parameters (a Cfg::Params*) for run r on a grid of ctas CTAs, built once and cached
  // by the plan
  virtual int prepare(RunArgs const& r, int ctas, void const** params) = 0;
  virtual int launch(void const* params, cudaStream_t stream) = 0;
  virtual int cluster_size() const = 0;

  // Setup kernel + GEMM on `stream`.
  int run(RunArgs const& r, cudaStream_t stream) {
    int rc = check_run(r);
    if (rc) return rc;
    if (r.max_items == 0) return SR_OK;  // nothing can be ready (the Triton launchers return too)
    // grid size in whole clusters (at least one): max_ctas <= 0, one wave (a CTA per SM); below the SMs, a
    // capped persistent grid (SMs left to other streams); above, an oversubscribed grid (at most
    // kMaxCtasPerSm per SM) that runs in waves, each CTA looping over about tiles / ctas tiles, so CTAs
    // retire during the call and the CTAs of higher-priority streams get SMs between them
    int const cs = cluster_size();
    int ctas = r.max_ctas > 0 ? std::min(r.max_ctas, sm_count * kMaxCtasPerSm) : sm_count;
    ctas = std::max(cs, ctas / cs * cs);
    void const* params = nullptr;
    rc = prepare(r, ctas, &params);
    if (rc) return rc;
    rc = launch_setup(r, stream);
    if (rc) return rc;
    return launch(params, stream);
  }

  // The setup kernel alone (tests read its output back with read_groups).
  int setup_only(RunArgs const& r, cudaStream_t stream) {
    int rc = check_run(r);
    if (rc) return rc;
    if (r.max_items == 0) return SR_OK;
    return launch_setup(r, stream);
  }

  // The plan's device: its SM count; a refusal unless it is what the kernels are built for.
  int query_device(char const* what) {
    SR_CUDA(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
    int major = 0, minor = 0;
    SR_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    SR_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major != 9 || minor != 0)
      return fail(SR_ERR_DEVICE, std::string(what) + " is built for sm_90a (H100/H200); device " +
                                     std::to_string(device) + " has compute capability " + std::to_string(major) +
                                     "." + std::to_string(minor));
    return SR_OK;
  }

  // Shared memory above 48 KB must be opted into, once per kernel (not during a capture); then how
  // many of its clusters fit on the device (max_active_clusters).
  template <class GemmKernel>
  int prepare_kernel() {
    int smem = GemmKernel::SharedStorageSize;
    SR_CUDA(cudaFuncSetAttribute(cutlass::device_kernel<GemmKernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    max_active_clusters = cutlass::KernelHardwareInfo::query_device_max_active_clusters<GemmKernel>();
    if (max_active_clusters <= 0) {
      cudaError_t e = cudaGetLastError();
      return fail(SR_ERR_CUDA, std::string("cudaOccupancyMaxActiveClusters found no cluster of this kernel fits "
                                           "on the device (shared memory ") + std::to_string(smem) + " B): " +
                                   cudaGetErrorString(e));
    }
    return SR_OK;
  }

  template <class Gemm>
  int launch_gemm(void const* params, cudaStream_t stream, char const* what) {
    using Params = typename Gemm::GemmKernel::Params;
    cutlass::Status st = Gemm::run(*const_cast<Params*>(static_cast<Params const*>(params)), stream);
    if (st != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      return fail(SR_ERR_CUTLASS, std::string(what) + " launch failed: " + cutlass::cutlassGetStatusString(st) +
                                      " / " + cudaGetErrorString(e));
    }
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

  // Before read_groups copies `count` entries back: the count checked, the device's work finished.
  int begin_read(int count) {
    if (count < 0 || count > capacity) return fail(SR_ERR_ARG, "count outside [0, capacity]");
    int rc = check_device();
    if (rc) return rc;
    SR_CUDA(cudaDeviceSynchronize());
    return SR_OK;
  }

  SetupArgs setup_args(RunArgs const& r) const {
    return SetupArgs{r.ready_list, r.ready_len, r.ready_hi, r.lo_index, r.hi_index, r.max_items, r.block_expert,
                     r.num_blocks, r.num_experts, r.block_m, n, k, static_cast<char const*>(r.a),
                     reinterpret_cast<char const*>(r.a_sf), static_cast<char const*>(r.w),
                     reinterpret_cast<char const*>(r.w_sf), static_cast<char*>(r.d), r.status, trap_on_error};
  }

  // The checks of every run (a plan kind adds its own before them).
  int check_common_run(RunArgs const& r) {
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
};

template <class Cfg>
struct Plan final : PlanBase {
  using Gemm = typename Cfg::Gemm;
  using GemmKernel = typename Cfg::GemmKernel;

  void* arrays = nullptr;     // every problem array, one allocation
  void* workspace = nullptr;  // CUTLASS's (tensormaps per SM)
  size_t workspace_bytes = 0;
  ProblemArrays<Cfg> p{};
  std::mutex mu;
  std::map<std::pair<int, int>, typename Cfg::Params> params_cache;  // (max_items, ctas) -> kernel params

  ~Plan() override {
    if (arrays) cudaFree(arrays);
    if (workspace) cudaFree(workspace);
  }

  int create() override {
    int rc = query_device("the CUTLASS FP8 blockwise grouped GEMM");
    if (rc) return rc;
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
    rc = prepare_kernel<GemmKernel>();
    if (rc) return rc;
    // the tensormap workspace holds a slot per CTA: sized for the largest (oversubscribed) grid
    auto args = arguments(capacity, sm_count * kMaxCtasPerSm);
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
    // CUTLASS sizes the persistent grid as max_active_clusters clusters (grid_clusters: within one wave at
    // most what fits on the device; a smaller grid leaves SMs to other streams, like the Triton path's
    // max_ctas; a larger one runs in waves). With no host problem shapes the group scheduler takes
    // hw.sm_count as the tile count to truncate the grid by: ctas, so nothing is truncated.
    hw.max_active_clusters = grid_clusters(ctas, size(typename Cfg::ClusterShape{}));
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

  // (the tensormap workspace is indexed by CTA and sized for kMaxCtasPerSm CTAs per SM, so any grid fits)
  int prepare(RunArgs const& r, int ctas, void const** out) override {
    std::lock_guard<std::mutex> lock(mu);
    auto key = std::make_pair(r.max_items, ctas);
    auto it = params_cache.find(key);
    if (it == params_cache.end()) {
      auto args = arguments(r.max_items, ctas);
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

  int launch_setup(RunArgs const& r, cudaStream_t stream) override {
    SetupArgs s = setup_args(r);
    setup_groups_kernel<Cfg><<<1, kSetupThreads, 0, stream>>>(s, p);
    SR_CUDA(cudaGetLastError());
    return SR_OK;
  }

  int check_run(RunArgs const& r) override { return check_common_run(r); }

  int cluster_size() const override { return size(typename Cfg::ClusterShape{}); }

  int launch(void const* params, cudaStream_t stream) override {
    return launch_gemm<Gemm>(params, stream, "CUTLASS grouped GEMM");
  }

  int read_groups(int count, int* m_out, int64_t* a_out, int64_t* b_out, int64_t* sfa_out, int64_t* sfb_out,
                  int64_t* d_out) override {
    int rc = begin_read(count);
    if (rc) return rc;
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

// ------------------------------------------------------------------------------------------------
// Pair variants: one 128-row block per tile, two ready blocks per 2-CTA cluster
// ------------------------------------------------------------------------------------------------
// Why: in the grouped kernels above, the persistent CTAs that share an expert's weight tile drift
// apart, and with K = 7168 a 128-wide weight panel is 0.9 MB: the 132 tiles in flight touch more
// than the 50 MB L2 holds, so each expert's weights come from HBM about 2.5 times at 8192 tokens
// (Nsight Compute, docs/performance.md). Variant 4's 2x1 cluster shares the weight tile through TMA
// multicast but rounds every group up to the cluster. Here the two CTAs of a cluster take ready
// items 2p and 2p+1 (consecutive in ready order) at the same N tile, and multicast the weight tile
// when both blocks are one expert's - decided per tile, so nothing is rounded up. One TMA
// descriptor per operand covers every block (A and D are [rows, X] with the expert as CUTLASS's
// batch mode of stride 0, W is [E][N, K] with the expert as its batch mode), so there is no
// per-group tensormap update either.
//
// Bitwise contract: a tile is exactly one block (block_m = tile M = 128), every tile runs its whole
// K loop in order with the same promotion as the grouped kernels, and the multicast changes only who
// issues a weight tile's loads, never the bytes that arrive. A block's padding rows are computed from
// its own padding rows and stored into its own rows of D. An odd item count leaves the last cluster
// one item: both CTAs compute it (identical bytes to the same rows).

struct PairSchedulerTag {};

// The rows of a block for the one-block plans: a cooperative tile is one block, a ping-pong tile half.
constexpr int kBlockTileRows = 128;

// A pair plan's swizzle s orders its tiles in bands of kPairBandPerSwizzle * s pairs (2 to 16 pairs:
// a 16-pair band's activation rows, 29 MB at K = 7168, still fit the 50 MB L2 beside its weight tiles).
constexpr int kPairBandPerSwizzle = 2;

// (outside the class: GCC wants a nested struct's member initializers complete before a default argument uses it)
struct PairSchedulerArguments : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::Arguments {
  int const* item_block = nullptr;   // block id of ready item j (valid items only, ready order)
  int const* item_expert = nullptr;  // its expert
  int const* item_count = nullptr;   // how many items (written on the device by the setup kernel)
  int band_pairs = 1;
};
struct PairSchedulerParams : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::Params {
  int const* item_block = nullptr;
  int const* item_expert = nullptr;
  int const* item_count = nullptr;
  int tiles_n = 0;
  int band_pairs = 1;
  int along_n = 0;
  int cluster_m = 2;  // items per cluster: 2 (pairs) or 1
  int cluster_n = 1;  // N tiles of one item per cluster: 1, or 2 (the A tile multicast)
  int tiles_per_block = 1;  // M tiles per block: 1, or 2 (64-row ping-pong tiles, one-item clusters)
};

// CUTLASS's static persistent scheduler with the tile order replaced: unit u of a cluster is
// (pair, N tile); pairs are cut into bands of band_pairs pairs, and inside a band the order is along
// M (the band's pairs at N tile 0, then at N tile 1, ...: the band's activation rows stay in L2 while
// its weight tiles are shared by the pairs of one expert) or, with raster along N, every N tile of a
// pair before the next pair. Items come from the setup kernel (item_block / item_expert / item_count).
class PairScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using Arguments = PairSchedulerArguments;
  using Params = PairSchedulerParams;

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        uint32_t epilogue_subtile = 1, uint32_t ktile_start_alignment_count = 1u) {
    static_assert(size<0>(ClusterShape{}) <= 2 && size<1>(ClusterShape{}) <= 2 && size<2>(ClusterShape{}) == 1,
                  "the pair scheduler takes clusters of 1 or 2 items (M) by 1 or 2 N tiles of each");
    Params p;
    static_cast<Base::Params&>(p) = Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape,
                                                                   hw_info, args, workspace, epilogue_subtile,
                                                                   ktile_start_alignment_count);
    p.item_block = args.item_block;
    p.item_expert = args.item_expert;
    p.item_count = args.item_count;
    p.tiles_n = int((int64_t(get<1>(problem_shape_mnkl)) + size<1>(TileShape{}) - 1) / size<1>(TileShape{}));
    p.band_pairs = args.band_pairs > 0 ? args.band_pairs : 1;
    p.along_n = args.raster_order == RasterOrderOptions::AlongN ? 1 : 0;
    p.cluster_m = size<0>(ClusterShape{});
    p.cluster_n = size<1>(ClusterShape{});
    static_assert(kBlockTileRows % size<0>(TileShape{}) == 0, "a block is a whole number of tiles");
    p.tiles_per_block = kBlockTileRows / size<0>(TileShape{});
    static_assert(kBlockTileRows == size<0>(TileShape{}) || size<0>(ClusterShape{}) == 1,
                  "a pair cluster takes whole blocks");
    return p;
  }

  // The persistent grid: max_active_clusters clusters along x (the plan caps it).
  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  static dim3 get_grid_shape(Params const&, ProblemShapeMNKL, BlockShape, ClusterShape,
                             cutlass::KernelHardwareInfo hw_info, Arguments = Arguments{}, bool = true) {
    int const cm = size<0>(ClusterShape{}), cn = size<1>(ClusterShape{});
    int clusters = hw_info.max_active_clusters > 0 ? hw_info.max_active_clusters : hw_info.sm_count / (cm * cn);
    return dim3(cm * std::max(1, clusters), cn, 1);
  }

  CUTLASS_HOST_DEVICE PairScheduler() {}

  CUTLASS_DEVICE explicit PairScheduler(Params const& p) : p_(p) {
#if defined(__CUDA_ARCH__)
    int const rank = int(cute::block_rank_in_cluster());  // x (along M) fastest
    rank_ = rank % p.cluster_m;
    rank_n_ = rank / p.cluster_m;
    unit_ = int64_t(blockIdx.x / p.cluster_m);  // the grid is (cluster_m * clusters, cluster_n)
    clusters_ = int64_t(gridDim.x / p.cluster_m);
    units_n_ = (p.tiles_n + p.cluster_n - 1) / p.cluster_n;
    // written by the setup kernel earlier on this stream (no programmatic dependent launch here)
    count_ = *p.item_count * p.tiles_per_block;  // the M tiles, a block's in a row
    pairs_ = (count_ + p.cluster_m - 1) / p.cluster_m;
    units_ = int64_t(pairs_) * units_n_;
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) { return work_for(unit_); }

  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work_for(unit_); }

  CUTLASS_DEVICE WorkTileInfo work_for(int64_t u) const {
    if (u >= units_) return WorkTileInfo::invalid_work_tile();
    int64_t const band_units = int64_t(p_.band_pairs) * units_n_;
    int64_t const band = u / band_units;
    int const off = int(u - band * band_units);
    int const first = int(band) * p_.band_pairs;
    int pair, tile_n;
    if (p_.along_n) {
      pair = first + off / units_n_;
      tile_n = off % units_n_;
    } else {
      int const in_band = min(p_.band_pairs, pairs_ - first);
      tile_n = off / in_band;
      pair = first + off % in_band;
    }
    tile_n = tile_n * p_.cluster_n + rank_n_;  // past N on an odd tile count: TMA zero-fills, stores nothing
    int j = p_.cluster_m * pair + rank_;
    if (j >= count_) j = p_.cluster_m * pair;  // the last pair of an odd count: both CTAs take the item
    int const item = j / p_.tiles_per_block;
    return {p_.item_block[item] * p_.tiles_per_block + j % p_.tiles_per_block, tile_n, p_.item_expert[item], true};
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    unit_ += clusters_;
    return cute::make_tuple(work_for(unit_), true);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo w, TileSchedulerPipeline&, TileSchedulerPipelineState) {
    return fetch_next_work(w);
  }

  // (the ping-pong kernel steps its two consumer warpgroups through alternate units this way)
  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) { unit_ += clusters_ * int64_t(advance_count); }

  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    return !work_for(unit_ + clusters_ * int64_t(advance_count)).is_valid();
  }

 private:
  Params p_{};
  int rank_ = 0, rank_n_ = 0, units_n_ = 1, count_ = 0, pairs_ = 0;
  int64_t unit_ = 0, clusters_ = 1, units_ = 0;
};

// CUTLASS's FP8 blockwise mainloop with the weight tile's multicast decided per tile. The scheduler
// puts a tile's expert in the batch coordinate l; partner_expert[block] is the expert of the block's
// partner in its cluster (set by the setup kernel for this run), so both CTAs of a cluster reach the
// same decision: multicast (each loads one half of the weight tile into both CTAs) when the experts
// match, else each CTA loads both halves into itself. Either way each CTA's barrier receives the
// whole tile's bytes, as the pipeline's transaction count expects. The stage release is cluster-wide
// in both cases (PipelineTmaAsync over the 2x1 cluster), which is only stricter than needed when the
// tile is not shared; the two CTAs run the same number of tiles with the same K, so they stay paired.
template <class Base>
struct PairMulticastMainloop : Base {
  using BaseArguments = typename Base::Arguments;
  using BaseParams = typename Base::Params;
  using typename Base::DispatchPolicy;
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::SmemLayoutA;
  using typename Base::SmemLayoutB;
  using typename Base::GmemTiledCopyB;
  using ClusterShape = typename DispatchPolicy::ClusterShape;

  struct Arguments : BaseArguments {
    int const* partner_expert = nullptr;
  };
  struct Params : BaseParams {
    int const* partner_expert = nullptr;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args, void* workspace) {
    Params p;
    static_cast<BaseParams&>(p) = Base::to_underlying_arguments(problem_shape, static_cast<BaseArguments const&>(args),
                                                                workspace);
    p.partner_expert = args.partner_expert;
    return p;
  }

  template <class TensorA, class TensorB, class TensorScaleA, class TensorScaleB, class KTileIterator,
            class BlockCoord>
  CUTLASS_DEVICE void load(Params const& mainloop_params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                           cute::tuple<TensorA, TensorB, TensorScaleA, TensorScaleB> const& load_inputs,
                           BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                           uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    static_assert(!Base::IsTmaLoadSFA && !Base::IsTmaLoadSFB, "the scales are loaded by the auxiliary warp (cp.async)");
    constexpr int kClusterN = size<1>(ClusterShape{});
    static_assert(size<0>(ClusterShape{}) == 2 && kClusterN <= 2, "a 2x1 or 2x2 cluster");
    static_assert(cute::is_same_v<GmemTiledCopyB, SM90_TMA_LOAD_MULTICAST>, "the weight tile is multicast along M");
    (void)thread_idx;
    int lane_predicate = cute::elect_one_sync();
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), SmemLayoutA{});  // (BLK_M,BLK_K,PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), SmemLayoutB{});  // (BLK_N,BLK_K,PIPE)
    Tensor gA_mkl = get<0>(load_inputs);
    Tensor gB_nkl = get<1>(load_inputs);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor gA = gA_mkl(_, _, m_coord, _, l_coord);  // the batch mode of A has stride 0: l does not move it
    Tensor gB = gB_nkl(_, _, n_coord, _, l_coord);  // expert l's weights
    auto block_layout = Layout<ClusterShape>{};  // (m, n) -> rank in the cluster
    uint32_t const cta_m = block_rank_in_cluster % 2, cta_n = block_rank_in_cluster / 2;
    // A: with two N tiles per cluster, the two CTAs of one item (same m) each load half and multicast
    // it to both (always valid: one block); with one, each CTA loads its own.
    auto tma_a = mainloop_params.tma_load_a.get_slice(cta_n);
    uint16_t mask_a = 0;
    if constexpr (kClusterN == 2) {
      for (int n = 0; n < kClusterN; ++n) mask_a |= uint16_t(1u << block_layout(cta_m, n, Int<0>{}));
    }
    Tensor tAgA = tma_a.partition_S(gA);
    Tensor tAsA = tma_a.partition_D(sA);
    auto tma_b0 = mainloop_params.tma_load_b.get_slice(0);
    auto tma_b1 = mainloop_params.tma_load_b.get_slice(1);
    Tensor tBgB0 = tma_b0.partition_S(gB);
    Tensor tBsB0 = tma_b0.partition_D(sB);
    Tensor tBgB1 = tma_b1.partition_S(gB);
    Tensor tBsB1 = tma_b1.partition_D(sB);
    // B: the two CTAs of one N tile (same n, items 2p and 2p+1)
    uint16_t const both = uint16_t((1u << block_layout(0, cta_n, Int<0>{})) | (1u << block_layout(1, cta_n, Int<0>{})));
    uint16_t const self = uint16_t(1u << block_rank_in_cluster);
    bool const shared = mainloop_params.partner_expert[m_coord] == int(l_coord);
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      int write_stage = smem_pipe_write.index();
      using BarrierType = typename MainloopPipeline::ProducerBarrierType;
      BarrierType* tma_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      if (lane_predicate) {
        copy(mainloop_params.tma_load_a.with(*tma_barrier, mask_a), tAgA(_, _, _, *k_tile_iter), tAsA(_, _, _, write_stage));
        if (shared) {
          if (cta_m == 0)
            copy(mainloop_params.tma_load_b.with(*tma_barrier, both), tBgB0(_, _, _, *k_tile_iter), tBsB0(_, _, _, write_stage));
          else
            copy(mainloop_params.tma_load_b.with(*tma_barrier, both), tBgB1(_, _, _, *k_tile_iter), tBsB1(_, _, _, write_stage));
        } else {
          copy(mainloop_params.tma_load_b.with(*tma_barrier, self), tBgB0(_, _, _, *k_tile_iter), tBsB0(_, _, _, write_stage));
          copy(mainloop_params.tma_load_b.with(*tma_barrier, self), tBgB1(_, _, _, *k_tile_iter), tBsB1(_, _, _, write_stage));
        }
      }
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }
};

}  // namespace sr

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<sr::PairSchedulerTag, ArchTag, TileShape, ClusterShape, SchedulerPipelineStageCount> {
  using Scheduler = sr::PairScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

namespace sr {

// ClusterM_ 2: the pair kernel above; 1: the same layout and tile order, one item per CTA, every
// CTA loading its own tiles (no multicast, no cluster-wide stage release); ClusterN_ 2 (with
// ClusterM_ 1): the two CTAs take adjacent N tiles of one item and CUTLASS's own mainloop multicasts
// the A tile (always valid: one block, one expert).
template <class TileShape_, class ElementD_, int SfN_ = 128, int ClusterM_ = 2, int ClusterN_ = 1,
          class KernelSchedule_ = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise,
          class EpilogueSchedule_ = cutlass::epilogue::TmaWarpSpecializedCooperative>
struct PairConfig {
  static constexpr int kSfN = SfN_;
  static constexpr int kClusterM = ClusterM_;
  static constexpr int kClusterSize = ClusterM_ * ClusterN_;
  using TileShape = TileShape_;
  using ClusterShape = Shape<Int<ClusterM_>, Int<ClusterN_>, _1>;
  using ElementA = cutlass::float_e4m3_t;
  using ElementB = cutlass::float_e4m3_t;
  using ElementC = void;
  using ElementD = ElementD_;
  // (rows, K, expert): the expert is the batch mode, with stride 0 for A and D (one buffer of rows)
  using StrideA = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
  using StrideB = cute::Stride<int64_t, cute::Int<1>, int64_t>;  // W[e][N, K]
  using StrideD = cute::Stride<int64_t, cute::Int<1>, cute::Int<0>>;
  static constexpr int AlignmentA = 16, AlignmentB = 16;
  static constexpr int AlignmentD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ScaleConfig = BlockwiseScaleConfig<SfN_>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using ProblemShape = Shape<int, int, int, int>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementCompute, ElementC, StrideD,
      AlignmentD, ElementD, StrideD, AlignmentD, EpilogueSchedule_,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementCompute, ElementC, ElementCompute>>::CollectiveOp;

  using BaseMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<StrideA, LayoutSFA>, AlignmentA,
      ElementB, cute::tuple<StrideB, LayoutSFB>, AlignmentB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;
  using CollectiveMainloop = cute::conditional_t<ClusterM_ == 2, PairMulticastMainloop<BaseMainloop>, BaseMainloop>;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue,
                                                          PairSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using Params = typename GemmKernel::Params;
  using Arguments = typename Gemm::Arguments;
};

// Ready range -> the pair kernel's items (one CTA; deterministic): the valid items in ready order,
// their count, and each item's partner expert by block id. The range checks and status bits are the
// grouped setup's; a block id met twice with different partners is refused (SR_STATUS_DUPLICATE_BLOCK,
// nothing computed): the two CTAs of a cluster must reach one multicast decision.
struct PairSetupArgs {
  SetupArgs s;
  int* item_block;
  int* item_expert;
  int* item_count;
  int* partner_expert;  // [capacity >= num_blocks]
  int pairs;            // 1: items 2p and 2p+1 share a cluster (partners checked); 0: one item per CTA
};

static __global__ void __launch_bounds__(kSetupThreads, 1) setup_pairs_kernel(PairSetupArgs ps) {  // static: one per part
  SetupArgs const& s = ps.s;
  __shared__ int s_flags;
  if (threadIdx.x == 0) s_flags = 0;
  __syncthreads();
  int const lo = s.ready_hi[s.lo_index];
  int const hi = s.ready_hi[s.hi_index];
  int const n = ready_item_count(s, lo, hi, &s_flags);
  int carry = 0;
  for (int base = 0; base < n; base += kSetupThreads) {
    int i = base + threadIdx.x;
    int bid = -1, e = -1, ok = 0;
    if (i < n) {
      ok = load_item(s, lo, i, &bid, &e);
      if (!ok) atomicOr(&s_flags, (bid < 0 || bid >= s.num_blocks) ? SR_STATUS_BAD_BLOCK : SR_STATUS_BAD_EXPERT);
    }
    int total;
    int before = block_exclusive_scan(ok, &total);
    if (ok) {
      ps.item_block[carry + before] = bid;
      ps.item_expert[carry + before] = e;
    }
    carry += total;
  }
  int const count = carry;
  if (ps.pairs) {  // (uniform across the CTA: the __syncthreads below are reached by every thread)
    // item j's partner in its cluster: j ^ 1, or j itself for the last item of an odd count
    auto partner = [count](int j) { return (j ^ 1) < count ? (j ^ 1) : j; };
    __syncthreads();  // items written above are read below (same CTA: __syncthreads orders global memory)
    for (int j = threadIdx.x; j < count; j += kSetupThreads)
      ps.partner_expert[ps.item_block[j]] = ps.item_expert[partner(j)];
    __syncthreads();
    int bad = 0;
    for (int j = threadIdx.x; j < count; j += kSetupThreads)
      if (ps.partner_expert[ps.item_block[j]] != ps.item_expert[partner(j)]) bad = 1;
    if (bad) atomicOr(&s_flags, SR_STATUS_DUPLICATE_BLOCK);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    *ps.item_count = (s_flags & SR_STATUS_DUPLICATE_BLOCK) ? 0 : count;
    report_setup_flags(s, s_flags, lo, hi);
  }
}

template <class Cfg>
struct PairPlan final : PlanBase {
  using Gemm = typename Cfg::Gemm;
  using GemmKernel = typename Cfg::GemmKernel;

  int* arrays = nullptr;  // item_block | item_expert | partner_expert (capacity each) | item_count
  RunArgs last{};  // the last setup's arguments (read_groups describes its items)
  std::mutex mu;
  // kernel parameters (TMA descriptors of the run's buffers) per (buffers, sizes, grid)
  std::map<std::vector<int64_t>, typename Cfg::Params> params_cache;

  ~PairPlan() override {
    if (arrays) cudaFree(arrays);
  }
  int* item_block() { return arrays; }
  int* item_expert() { return arrays + capacity; }
  int* partner_expert() { return arrays + 2 * size_t(capacity); }
  int* item_count() { return arrays + 3 * size_t(capacity); }

  int create() override {
    int rc = query_device("the CUTLASS FP8 blockwise pair GEMM");
    if (rc) return rc;
    SR_CUDA(cudaMalloc(&arrays, (3 * size_t(capacity) + 1) * sizeof(int)));
    SR_CUDA(cudaMemset(arrays, 0, (3 * size_t(capacity) + 1) * sizeof(int)));
    return prepare_kernel<GemmKernel>();
  }

  typename Cfg::Arguments arguments(RunArgs const& r, int ctas) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = ctas;
    hw.max_active_clusters = grid_clusters(ctas, Cfg::kClusterSize);
    int const rows = r.num_blocks * kBlockTileRows;
    auto sfa = Cfg::ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, n, k, r.num_experts));
    typename Cfg::LayoutSFA layout_sfa = make_layout(shape(sfa), replace<2>(stride(sfa), 0));  // one row buffer
    typename Cfg::LayoutSFB layout_sfb = Cfg::ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, n, k, r.num_experts));
    typename Cfg::StrideA stride_a = make_stride(int64_t(k), Int<1>{}, Int<0>{});
    typename Cfg::StrideB stride_b = make_stride(int64_t(k), Int<1>{}, int64_t(n) * k);
    typename Cfg::StrideD stride_d = make_stride(int64_t(n), Int<1>{}, Int<0>{});
    typename Cfg::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
    args.problem_shape = make_shape(rows, n, k, r.num_experts);
    auto& ml = args.mainloop;
    ml.ptr_A = static_cast<typename Cfg::ElementA const*>(r.a);
    ml.dA = stride_a;
    ml.ptr_B = static_cast<typename Cfg::ElementB const*>(r.w);
    ml.dB = stride_b;
    ml.ptr_SFA = r.a_sf;
    ml.layout_SFA = layout_sfa;
    ml.ptr_SFB = r.w_sf;
    ml.layout_SFB = layout_sfb;
    if constexpr (Cfg::kClusterM == 2) ml.partner_expert = partner_expert();
    auto& ep = args.epilogue;
    ep.ptr_C = nullptr;
    ep.dC = stride_d;
    ep.ptr_D = static_cast<typename Cfg::ElementD*>(r.d);
    ep.dD = stride_d;
    ep.thread.alpha = 1.0f;  // exact: D = round(acc)
    ep.thread.beta = 0.0f;
    args.hw_info = hw;
    args.scheduler.raster_order = raster == 1 ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN
                                              : cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
    args.scheduler.max_swizzle_size = 1;
    args.scheduler.band_pairs = kPairBandPerSwizzle * swizzle;
    args.scheduler.item_block = item_block();
    args.scheduler.item_expert = item_expert();
    args.scheduler.item_count = item_count();
    return args;
  }

  int prepare(RunArgs const& r, int ctas, void const** out) override {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<int64_t> key{reinterpret_cast<int64_t>(r.a), reinterpret_cast<int64_t>(r.a_sf),
                             reinterpret_cast<int64_t>(r.w), reinterpret_cast<int64_t>(r.w_sf),
                             reinterpret_cast<int64_t>(r.d), r.num_blocks, r.num_experts, ctas};
    auto it = params_cache.find(key);
    if (it == params_cache.end()) {
      auto args = arguments(r, ctas);
      cutlass::Status st = Gemm::can_implement(args);
      if (st != cutlass::Status::kSuccess)
        return fail(SR_ERR_CUTLASS, std::string("CUTLASS can_implement refused the pair GEMM: ") +
                                        cutlass::cutlassGetStatusString(st));
      if (Gemm::get_workspace_size(args) != 0) return fail(SR_ERR_CUTLASS, "the pair GEMM unexpectedly needs a workspace");
      it = params_cache.emplace(key, GemmKernel::to_underlying_arguments(args, nullptr)).first;
    }
    *out = &it->second;
    return SR_OK;
  }

  int check_run(RunArgs const& r) override {
    if (r.block_m != kBlockTileRows)
      return fail(SR_ERR_ARG, "variant " + std::to_string(variant) + " (one " + std::to_string(kBlockTileRows) +
                                  "-row block per item) needs block_m == " + std::to_string(kBlockTileRows) + ", got " +
                                  std::to_string(r.block_m));
    if (r.num_blocks > capacity)
      return fail(SR_ERR_ARG, "num_blocks=" + std::to_string(r.num_blocks) + " exceeds this plan's capacity=" +
                                  std::to_string(capacity) + " (the pair variants keep one entry per block id)");
    if (int64_t(r.num_blocks) * kBlockTileRows > INT32_MAX)
      return fail(SR_ERR_ARG, "num_blocks * " + std::to_string(kBlockTileRows) + " rows exceeds the 32-bit problem shape");
    return check_common_run(r);
  }

  int launch_setup(RunArgs const& r, cudaStream_t stream) override {
    PairSetupArgs ps{setup_args(r), item_block(), item_expert(), item_count(), partner_expert(), Cfg::kClusterM == 2 ? 1 : 0};
    setup_pairs_kernel<<<1, kSetupThreads, 0, stream>>>(ps);
    SR_CUDA(cudaGetLastError());
    last = r;
    return SR_OK;
  }

  int cluster_size() const override { return Cfg::kClusterSize; }

  int launch(void const* params, cudaStream_t stream) override {
    return launch_gemm<Gemm>(params, stream, "CUTLASS pair GEMM");
  }

  // The last setup's items as one-block groups: item g has M = 128 (0 past the count) and the
  // addresses its tile reads and writes.
  int read_groups(int count, int* m_out, int64_t* a_out, int64_t* b_out, int64_t* sfa_out, int64_t* sfb_out,
                  int64_t* d_out) override {
    int rc = begin_read(count);
    if (rc) return rc;
    int items = 0;
    SR_CUDA(cudaMemcpy(&items, item_count(), sizeof(int), cudaMemcpyDeviceToHost));
    std::vector<int> blocks(capacity), experts(capacity);
    SR_CUDA(cudaMemcpy(blocks.data(), item_block(), capacity * sizeof(int), cudaMemcpyDeviceToHost));
    SR_CUDA(cudaMemcpy(experts.data(), item_expert(), capacity * sizeof(int), cudaMemcpyDeviceToHost));
    int64_t const kk = k, nn = n, sfk = k / 128;
    int64_t const dsize = sizeof(typename Cfg::ElementD);
    for (int g = 0; g < count; ++g) {
      bool live = g < items;
      int64_t row0 = live ? int64_t(blocks[g]) * kBlockTileRows : 0, e = live ? experts[g] : 0;
      m_out[g] = live ? kBlockTileRows : 0;
      a_out[g] = reinterpret_cast<int64_t>(last.a) + row0 * kk;
      sfa_out[g] = reinterpret_cast<int64_t>(last.a_sf) + row0 * sfk * 4;
      b_out[g] = reinterpret_cast<int64_t>(last.w) + e * nn * kk;
      sfb_out[g] = reinterpret_cast<int64_t>(last.w_sf) + e * (nn / Cfg::kSfN) * sfk * 4;
      d_out[g] = reinterpret_cast<int64_t>(last.d) + row0 * nn * dsize;
    }
    return SR_OK;
  }
};

using V8 = PairConfig<CoopTile, cutlass::bfloat16_t>;
using V9 = PairConfig<Tile192, cutlass::bfloat16_t, 64>;
using V10 = PairConfig<CoopTile, cutlass::bfloat16_t, 128, 1>;
using V11 = PairConfig<CoopTile, cutlass::bfloat16_t, 128, 1, 2>;
using V12 = PairConfig<CoopTile, cutlass::bfloat16_t, 128, 2, 2>;
using V13 = PairConfig<PingTile, cutlass::bfloat16_t, 128, 1, 1, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise,
                       cutlass::epilogue::TmaWarpSpecialized>;

// Per variant: a new plan, and its description. Declared in every part, defined in the part that
// compiles the variant.
#define SR_VARIANT_DECL(i) \
  PlanBase* new_plan_##i(); \
  void variant_info_##i(int* out);
#define SR_VARIANT_DEF(i) \
  PlanBase* new_plan_##i() { return new Plan<V##i>(); } \
  void variant_info_##i(int* out) { VariantInfo<V##i>::fill(out); }
#define SR_PAIR_VARIANT_DEF(i) \
  PlanBase* new_plan_##i() { return new PairPlan<V##i>(); } \
  void variant_info_##i(int* out) { VariantInfo<V##i>::fill(out); }
SR_VARIANT_DECL(0)
SR_VARIANT_DECL(1)
SR_VARIANT_DECL(2)
SR_VARIANT_DECL(3)
SR_VARIANT_DECL(4)
SR_VARIANT_DECL(5)
SR_VARIANT_DECL(6)
SR_VARIANT_DECL(7)
SR_VARIANT_DECL(8)
SR_VARIANT_DECL(9)
SR_VARIANT_DECL(10)
SR_VARIANT_DECL(11)
SR_VARIANT_DECL(12)
SR_VARIANT_DECL(13)
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
#if SR_GEMM_OWNS(8)
SR_PAIR_VARIANT_DEF(8)
#endif
#if SR_GEMM_OWNS(9)
SR_PAIR_VARIANT_DEF(9)
#endif
#if SR_GEMM_OWNS(10)
SR_PAIR_VARIANT_DEF(10)
#endif
#if SR_GEMM_OWNS(11)
SR_PAIR_VARIANT_DEF(11)
#endif
#if SR_GEMM_OWNS(12)
SR_PAIR_VARIANT_DEF(12)
#endif
#if SR_GEMM_OWNS(13)
SR_PAIR_VARIANT_DEF(13)
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
    case 8: return new_plan_8();
    case 9: return new_plan_9();
    case 10: return new_plan_10();
    case 11: return new_plan_11();
    case 12: return new_plan_12();
    case 13: return new_plan_13();
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
    case 8: variant_info_8(out); return true;
    case 9: variant_info_9(out); return true;
    case 10: variant_info_10(out); return true;
    case 11: variant_info_11(out); return true;
    case 12: variant_info_12(out); return true;
    case 13: variant_info_13(out); return true;
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
// C entry points (ctypes: streamring/gemm/cutlass.py mirrors these signatures)
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
