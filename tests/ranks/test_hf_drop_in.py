"""The Hugging Face drop-in end to end on 2 real ranks (tests/helpers/mp_hf.py): a small random DeepseekV3ForCausalLM
(3 layers, the first dense, 16 routed experts, top-4, 4 groups / 2 kept, hidden 256, expert width 256), each
rank with its own tokens (11 and 18), its routed experts swapped for the layer; bf16 weights quantised by the
layer and FP8 checkpoint tensors with ``weight_scale_inv`` taken as they are.

Bounds (derived in tests/helpers/mp_hf.py's docstring), asserted on every rank:
* logits against transformers' model with the FP8-dequantised weights and fake-quantised expert inputs:
  max |diff| <= 1e-4 x max |logit| (float32 rounding only);
* logits against the unmodified model: no further than that FP8 reference is (triangle inequality), whose
  distance is what e4m3 predicts (<= 10 % RMS at the first MoE layer and at the logits; 6.5 % predicted);
* 0 tokens routed differently from transformers' float32 router on the same input; routing weights within
  1e-5; the bf16-checkpoint and FP8Experts-module sources give bitwise the logits of their twins;
* the whole model in bf16 (bf16 tokens through the op): within the FP8-level bound of the unmodified bf16 model;
* ``torch._dynamo.explain`` of the swapped model: each swapped layer one ``streamring.moe_forward`` node, no
  graph break pointing at it.
"""

import json

SCRIPT = "tests/helpers/mp_hf.py"


def hf_records(out: str) -> list[dict]:
    """Every rank's ``HF {...}`` record in the job's output. The launcher forwards the ranks' stdout
    through one pipe, so one rank's record can follow another's on the same line: each is decoded from
    its own ``HF {`` to the end of its JSON object."""
    dec, found, at = json.JSONDecoder(), [], out.find("HF {")
    while at >= 0:
        obj, end = dec.raw_decode(out, at + 3)
        found.append(obj)
        at = out.find("HF {", end)
    return found


def test_hf_deepseek_v3_drop_in_on_two_ranks(mpirun):
    r = mpirun(2, SCRIPT, "drop_in", timeout=300)
    assert r.rc == 0 and "SCENARIO OK" in r.out, r
    ranks = hf_records(r.out)
    assert sorted(x["rank"] for x in ranks) == [0, 1], r
    for x in ranks:
        assert [row["what"] for row in x["rows"]] == ["bf16 weights -> fp8 (module parameters)",
                                                      "fp8 checkpoint (weight_scale_inv)", "model in bf16"], x
        for row in x["rows"]:
            assert row["routing_flips_vs_hf_router"] == 0, row
        for row in x["rows"][:2]:
            assert row["tight_max_abs"] <= row["tight_bound"], row
        assert x["rows"][0]["moe_op_nodes"] == 2, x
