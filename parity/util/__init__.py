"""Utilities every stage may use and none owns: bad-input errors (:mod:`~parity.util.errors`), atomic
files and report folders (:mod:`~parity.util.files`), memory and disk checks (:mod:`~parity.util.resources`),
where models run (:mod:`~parity.util.devices`), one-line messages (:mod:`~parity.util.text`), source text read
once (:mod:`~parity.util.source`). Nothing here imports another part of parity."""
