# Copyright (c) Meta Platforms, Inc. and affiliates.
# All rights reserved.
#
# This source code is licensed under the BSD-style license found in the
# LICENSE file in the root directory of this source tree.

"""Reasoning Gym environment server components."""

from .reasoning_gym_environment import ReasoningGymEnvironment

__all__ = ["ReasoningGymEnvironment"]
