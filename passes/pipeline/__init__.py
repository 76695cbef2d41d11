"""Inter-op search: pipeline stages, schedules and microbatches over intra-op plans.

``layer_costs`` reads per-layer costs off an intra-op solution; ``stage_cut`` places
contiguous layers on stages (an ILP); ``search`` tries every stage count, schedule and
microbatch size and keeps the fastest plan that fits, with the runners-up.
"""
