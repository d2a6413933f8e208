"""The doctor: what is wrong with a run, and where. It runs on the driver (its looks at a rank's
stack run as Ray tasks on the rank's node), and imports no torch.

- diagnosis.py: the pure reading of the ranks' stacks: where each rank is, who the others wait for.
- stacks.py: taking the stacks (py-spy, on each rank's node) and ending ranks.
- stall_watch.py: `raytrain run`'s stall watch; launch_watch.py: `raytrain launch`'s.
- stragglers.py: which rank is slow, in which part of its steps.
- health.py: the pre-flight health check's verdict: which node is far below the others.
- bad_nodes.py: the nodes a run found bad, kept for a requeued Slurm job to leave out.
- ranks.py: the typed record of where a rank runs.
"""
