"""The expert GEMMs of the block consumer: one module per backend behind one interface, their measured
choice and their builds.

* ``backends``          the interface (``GemmBackend``: ``compute``, ``status``, ``check`` and what the choice
                        asks of a backend), ``Capabilities`` (a capped grid, L2 into the owners' rows, the
                        persistent consumer, block sizes...) and the one registry (``register_backend``) that
                        ``gemm=``, the choice and ``BlockConsumer.experts(impl)`` read; a backend is one module
                        that registers its class
* ``triton``            ``TritonExperts``: the Triton L1 + SwiGLU and L2 kernels of
                        ``streamring.device.moe_triton`` (there because the persistent consumer kernel,
                        ``device/persistent_moe.py``, is built from their tile functions, and device may
                        not import gemm)
* ``cutlass``           ``CutlassExperts``: the block consumer's L1/L2 through ``cutlass_lib``, the CUTLASS
                        FP8 blockwise grouped GEMM (ctypes launcher, variant table, argument checks, plans)
* ``deep_gemm``         DeepGEMM's grouped FP8 GEMM (availability, layouts) and ``DeepGemmExperts``;
                        ``deep_gemm_triton`` its one Triton kernel (kept apart: ``deep_gemm`` imports
                        without Triton)
* ``choice``            ``gemm="auto"``: the fastest available implementation of the measured table
                        (``table.json``), read through the registry (it names no backend)
* ``build``             ``python -m streamring.gemm.build --out .gemm-build``: the CUTLASS library
* ``build_deep_gemm``   ``python -m streamring.gemm.build_deep_gemm``: DeepGEMM from its carried source

Everything here may import ``streamring.device``, never ``moe`` or ``host`` (tests/unit/test_layering.py).
"""
