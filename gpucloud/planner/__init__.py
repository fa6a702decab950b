"""Capacity planner: pure functions from a model spec, hardware and a strategy to memory,
speed and cost plans, and recommendations. No torch here: the measured ground truth lives in
`gpucloud.train.memory_probe`."""

from gpucloud.planner.estimate import (
    ServePlan,
    TrainingPlan,
    estimate_inference,
    estimate_training,
)
from gpucloud.planner.recommend import Recommendation, recommend
from gpucloud.planner.setup import ServeSetup, TrainSetup

__all__ = [
    "Recommendation",
    "ServePlan",
    "ServeSetup",
    "TrainSetup",
    "TrainingPlan",
    "estimate_inference",
    "estimate_training",
    "recommend",
]
