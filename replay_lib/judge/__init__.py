"""How a recomputed value is judged, and the verdict's vocabulary (SPEC §5).

* ``error_model`` — the tolerance of each element: atol + rtol·|expected| + the producer's rounding bound, with
  storage units and clip-edge bounds.
* ``compare`` — element-wise comparison of a recomputed tensor against the recorded one (``Comparison``).
* ``fields`` — one compared field's result (``FieldResult``: per-sample, per-token, scalar) and a stage's report
  built from its fields.
* ``report`` — the report's data (``Divergence``, ``Hazard``, ``StageReport``, ``Explanation``,
  ``ReplayReport``), its JSON form and its text lines.

Imports ``bundle`` and ``kernels`` (the error model bounds the kernels' formulas); never a stage, an
explanation, the runner or a view.
"""
