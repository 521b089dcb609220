// The offsets of the packed `params` of policy_token_fwd and policy_token_loss: PARAMS of
// rlkernels/kernels/token_loss_params.py, in its order (python_tests/test_token_loss_table.py fails on any drift).
// No torch includes.
#pragma once

namespace rlk {

enum TokenLossParam : int {
  kParamObjective = 0,
  kParamClipLow,
  kParamClipHigh,
  kParamDelta,
  kParamDualClip,
  kParamKlEstimator,
  kParamKlCoef,
  kParamKlClamp,
  kParamKlBiasCorrection,
  kParamEntropyCoef,
  kParamLogRatioClamp,
  kParamSapoTauPos,
  kParamSapoTauNeg,
  kParamRatioCap,
  kParamDroBeta,
  kNumTokenLossParams
};

}  // namespace rlk
