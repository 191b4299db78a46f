# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Reasoning Gym Environment."""

from .client import ReasoningGymEnv
from .models import ReasoningGymAction, ReasoningGymObservation

__all__ = [
    "ReasoningGymAction",
    "ReasoningGymObservation",
    "ReasoningGymEnv",
]
