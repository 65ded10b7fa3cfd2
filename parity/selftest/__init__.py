"""Can the debugger see what it claims to see? A family's fault catalogue (:mod:`~parity.selftest.faults`)
injected one by one (:mod:`~parity.selftest.run`), and every declared config field changed on the
reference side only (:mod:`~parity.selftest.fields`): each must fail at its node with its hint kind."""
