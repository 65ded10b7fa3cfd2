"""A user's own model: :func:`~parity.user.check_model.check_model` builds it from the reference's
weights, aligns its modules to the reference's nodes by the weights both hold
(:mod:`~parity.user.align`; the reference's nodes from :mod:`~parity.user.reference_nodes`) and checks it."""
