"""The chunk-ready ring: its layout, protocol, device form and cooperative roles.

* ``layout``    RingLayout, CombineLayout, StreamPlan and the generation encoding (epoch, chunk)
* ``policies``  the named choices: progress policies, source orders, refused policies, mutations, GEMMs
* ``protocol``  the host protocol (publish/acquire/ack/reuse) with its ordering argument beside the code
* ``device``    the same protocol on a GPU: one typed method per ring kernel (DeviceRing)
* ``roles``     cooperative roles on one rank (generators stepped round-robin)

Everything here may import ``streamring.device`` (the backend verbs and kernels), nothing above it.
"""
