"""Who steps, and how: one batch's forward, backward, gradient sums, clip and optimizer step.

engines.py        the training config's engine: which MoE layer hosts the routing, and who steps
steppers.py       zero_grad, backward, gradient reduction, clip and step, by dist-moe or by the engine
training_step.py  one step, chosen once per run: plain (task + aux loss) or GAR's
gar_step.py       GAR's update (Algorithm 1)
grads.py          replicated gradients summed over the ranks, the global norm and clip
grad_overlap.py   those sums run while backward still runs, on a communicator of their own
"""
