// The domain of a selection-feedback entry (core/step.h StepInputs::feedback), shared by
// core/ and the GPU pre-pass: an entry is feedback when |entry| <= kFeedbackMax. NaN means
// "not visited"; ±inf or a value no attention writes (beyond it, √d·entry and the median's
// shifts would leave the float range) is no feedback either (core/select.h IsFeedback).
#pragma once

namespace eps {

inline constexpr float kFeedbackMax = 1e30f;

}  // namespace eps
