"""``meshfold calibrate``: measure what the time model assumes, on the ranks it will run on.

``probes`` measures on every rank at once, ``fitting`` fits the catalog's figures to the points
by least squares on the model's own formulas, ``from_trace`` refits rates from a profiled step,
and ``entry`` is the command. The file format is ``meshfold.target.cluster_file``'s.
"""
