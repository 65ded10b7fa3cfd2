"""What the engine knows about a model, and nothing it does: the facts of an architecture
(:mod:`~parity.model.facts`, derived from a Transformers config by :mod:`~parity.model.derive`, with
per-``model_type`` rules in :mod:`~parity.model.facts_rules`), a family's declaration
(:mod:`~parity.model.family`, found through :mod:`~parity.model.registry`), a Pair and its nodes
(:mod:`~parity.model.pair`), weight tables (:mod:`~parity.model.weights`) and config fields
(:mod:`~parity.model.fields`)."""
