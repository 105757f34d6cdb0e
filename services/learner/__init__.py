"""Learner: joins placements to their outcomes and learns the model that corrects the policy's confidence."""
