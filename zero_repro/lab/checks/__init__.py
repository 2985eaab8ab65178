"""Checks that run ranks to prove something about the runtime: the GPU proof's parts (``gpu``)
and the equivalence against a single-process torch reference they share with the tests
(``equivalence``)."""
