"""Launch priorities of a captured CUDA graph's kernel nodes (a captured node does not keep its stream's
priority): every node but the named low ones gets the high priority (CUDA driver graph API)."""

from __future__ import annotations


def prioritize_nodes(graph, low_funcs: set, priority: int, low_names: tuple = ()) -> str:
    """Give every kernel node of the captured ``graph`` whose function is not in ``low_funcs`` and whose name
    (``cuFuncGetName``: kernels launched by a library, whose handles Python does not see) contains none of
    ``low_names`` the launch priority ``priority`` (CUDA driver graph API). Returns a one-line report."""
    from cuda.bindings import driver as drv

    def is_low(func) -> bool:
        if int(func) in low_funcs:
            return True
        if not low_names:
            return False
        res = drv.cuFuncGetName(func)
        if res[0] != drv.CUresult.CUDA_SUCCESS:
            return False
        name = res[1].decode(errors="replace") if isinstance(res[1], bytes) else str(res[1])
        return any(part in name for part in low_names)

    def ok(res, what):
        err = res[0] if isinstance(res, tuple) else res
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {err}")
        return res[1:] if isinstance(res, tuple) else ()

    try:
        cg = drv.CUgraph(int(graph.raw_cuda_graph()))
        _, count = ok(drv.cuGraphGetNodes(cg, 0), "cuGraphGetNodes(count)")
        nodes, _ = ok(drv.cuGraphGetNodes(cg, count), "cuGraphGetNodes")
        kernel_type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        # the node-attribute flavour of the launch attribute (cuda-bindings wants these types)
        ids = getattr(drv, "CUkernelNodeAttrID", drv.CUlaunchAttributeID)
        attr = getattr(ids, "CU_KERNEL_NODE_ATTRIBUTE_PRIORITY", None)
        if attr is None:
            attr = ids.CU_LAUNCH_ATTRIBUTE_PRIORITY
        value_type = getattr(drv, "CUkernelNodeAttrValue", drv.CUlaunchAttributeValue)
        changed = kept = 0
        for node in nodes:
            (ntype,) = ok(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
            if ntype != kernel_type:
                continue
            (params,) = ok(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            if is_low(params.func):
                kept += 1
                continue
            val = value_type()
            val.priority = int(priority)
            ok(drv.cuGraphKernelNodeSetAttribute(node, attr, val), "cuGraphKernelNodeSetAttribute")
            changed += 1
        return f"{changed} kernel nodes set to priority {priority}, {kept} GEMM nodes left at the default"
    except Exception as exc:  # noqa: BLE001 - the graph still runs, without node priorities
        return f"node priorities not set: {type(exc).__name__}: {exc}"


