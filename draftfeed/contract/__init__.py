"""The supervision contract's math, computed the same way on both sides (docs/contract.md).

The worker (consumers/) and the rank (producers/) never import each other; what both compute from the
contract lives here once: shifting, lm_head logits and the target's logit transform, the zeros at padded
positions, vocab mappings (their checks and digest), the compact form's rebuild, and the supervision types
a rank receives. Needs torch; the wire layer (schemas/) does not.
"""
