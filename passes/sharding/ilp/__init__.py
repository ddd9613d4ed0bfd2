"""The sharding solve: one integer program per mesh axis, handed to HiGHS."""
