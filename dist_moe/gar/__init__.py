"""GAR (Li et al., "Routing in Gradient Space: Balanced Usage Is Not Expert Specialization"):
an auxiliary router objective built from gradient observations, for any differentiable router.

observe.py   the (g_m, p_m) observations, collected during task-gradient accumulation
factors.py   observations from expert block factors (appendix G.2)
The criterion and the ``train.gar`` settings (``GARConfig``) are in ``dist_moe.routing.gar``; one GAR update
(Algorithm 1: task gradients, L_norm's gradient, clip, step) is a training step, ``dist_moe.train.step.gar_step``.
"""
