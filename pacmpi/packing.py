"""What a rank packs: the strategy a :class:`pacmpi.engine.StepEngine` asks at the three
places where it matters (the ternary scales, the quantized values, the payload of a step sent
unquantized), so that a front end of another shape plugs in without touching the step.

:class:`OwnGradient`, the default, packs the rank's own gradient;
:class:`pacmpi.hierarchy.NodeSum` packs its node's sum.
"""

__all__ = ["OwnGradient"]


class OwnGradient:
    """What a rank packs: its own gradient (the default strategy of :class:`StepEngine`).

    ``fuses_scales``: ternary scales of gradients at hand may ride in the verification's
    all-reduce. ``compacts_in_place``: encoded in place, a packed ternary payload is quantized
    from the bucket's compacted front. ``residual_of_survivors``: a ternary bucket sent dense
    while its mask is checked keeps the residual of this rank's survivors only (the others'
    gradient is zeroed, so their residual stays 0; kept, it made every coordinate's residual
    1x the gradient bytes for those steps, the hook's and the reducer's peak)."""

    fuses_scales = compacts_in_place = residual_of_survivors = True

    def ranks(self, collectives):
        """How many ranks' ternary codes one payload sum adds up."""
        return collectives.size

    def keeps_residual(self, collectives):
        return True

    def scaled(self, engine, u, flat):
        """What this rank takes the scales of (``(values, compact)``: laid out as the payload
        when ``compact``; ``values`` ``None``: it adds nothing to the MAX)."""
        return flat, False

    def quantized(self, engine, u, flat, compact):
        """What this rank quantizes at the encode, as :meth:`scaled` (``None``: digit 0
        everywhere)."""
        return flat, compact

    def unquantized(self, engine, u, flat):
        """Payload and context of ``u`` sent as it is (a non-finite scale on some rank)."""
        return engine.gathered(u, flat)
