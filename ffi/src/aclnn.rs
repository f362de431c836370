//! aclnn prototypes: the tensor/array/executor objects of `libnnopbase.so`
//! (`aclnn/acl_meta.h`) and the operators a Llama step needs from `libopapi.so` (and, in the
//! split packaging of newer CANN, `libopapi_transformer.so` / `libopapi_nn.so` /
//! `libopapi_math.so`), each as its documented two-phase pair: `aclnnXxxGetWorkspaceSize(...,
//! &workspaceSize, &executor)` then `aclnnXxx(workspace, workspaceSize, executor, stream)`.
//!
//! Sources (operator API reference, "aclnnXxx" pages; headers `aclnnop/aclnn_*.h`):
//! Add/InplaceAdd (`aclnn_add.h`), Cast (`aclnn_cast.h`), InplaceCopy (`aclnn_copy.h`),
//! NanToNum (`aclnn_nan_to_num.h`), LogSoftmax (`aclnn_log_softmax.h`), Gather (`aclnn_gather.h`),
//! Mul (`aclnn_mul.h`), DynamicQuant (`aclnn_dynamic_quant.h`),
//! RmsNorm (`aclnn_rms_norm.h`), SwiGlu (`aclnn_swi_glu.h`), Embedding (`aclnn_embedding.h`),
//! ArgMax (`aclnn_argmax.h`),
//! Matmul (`aclnn_matmul.h`), WeightQuantBatchMatmulV2 (`aclnn_weight_quant_batch_matmul_v2.h`),
//! FusedInferAttentionScoreV2 (`aclnn_fused_infer_attention_score_v2.h`; its incremental branch
//! serves decode, so IncreFlashAttention is not declared), ApplyRotaryPosEmb
//! (`aclnn_apply_rotary_pos_emb.h`),
//! ScatterNdUpdate (`aclnn_scatter_nd_update.h`); newer releases only: RotaryPositionEmbedding
//! (`aclnn_rotary_position_embedding.h`) and ScatterPaKvCache (`aclnn_scatter_pa_kv_cache.h`).
//! Optional too, for the newer model families (the backend reports the capabilities they serve
//! only where the release has them): GeluV2 (`aclnn_gelu_v2.h`, GELU with `approximate` 0 erf /
//! 1 tanh), InplaceMul and InplaceMuls (`aclnn_mul.h`, by a broadcast tensor / a host scalar).
//! Optional, to fold a residual add into the next norm: AddRmsNorm (`aclnn_add_rms_norm.h`:
//! `xOut = x1 + x2`, `yOut` its RmsNorm, `rstdOut` the reciprocal RMS).
//! Optional, for mixture-of-experts layers: MoeGatingTopKSoftmaxV2
//! (`aclnn_moe_gating_top_k_softmax_v2.h`: softmax and top-k over gating logits, `renorm` 1 for
//! top-k first then softmax over the chosen), MoeFinalizeRoutingV2
//! (`aclnn_moe_finalize_routing_v2.h`: the experts' rows weighted and summed back per token),
//! MoeInitRoutingV2 (`aclnn_moe_init_routing_v2.h`: the tokens' rows grouped by expert on the
//! device, with the row map and each expert's cumulative row count) and GroupedMatmulV4
//! (`aclnn_grouped_matmul_v4.h`: every expert's matmul over its group of rows in one call,
//! f16 or A16W4 per-group antiquant weights). Optional, for DeepSeek's routing: MoeGatingTopK
//! (`aclnn_moe_gating_top_k.h`: sigmoid scores (normType 1; softmax, normType 0, from CANN 8.5),
//! a selection bias, group-limited choice by each group's two best (groupSelectMode 1), the top
//! k, the chosen scores over their sum plus eps, times routedScalingFactor).
//! Optional, for DeepSeek's latent attention at its own widths: FusedInferAttentionScoreV3
//! (`aclnn_fused_infer_attention_score_v3.h`: V2's parameters plus queryRopeOptional,
//! keyRopeOptional and keyRopeAntiquantScaleOptional; with the rope inputs, its MLA form).
//! Optional, for tensor parallelism: MatmulAllReduce (`aclnn_matmul_all_reduce.h`: `output =
//! AllReduce(x1 @ x2 + bias)` over the HCCL communicator named `group` (`HcclGetCommName`),
//! reduceOp "sum", commTurn 0, streamMode 1; Atlas A2, not A3) and WeightQuantMatmulAllReduce
//! (`aclnn_weight_quant_matmul_all_reduce.h`: WeightQuantBatchMatmulV2's antiquant product, plus
//! an optional `x3` added before the all-reduce, with the same group arguments).

use core::ffi::{c_char, c_int, c_void};

pub use crate::types::*;

/// Executor reuse and tensor objects, resolved from `libnnopbase.so`.
pub mod base {
    use super::*;
    crate::api_table! {
        /// aclnn's object API: tensors, scalars, int arrays, tensor lists, executor reuse.
        pub struct AclnnBaseApi ("libnnopbase.so") {
            required {
                fn aclCreateTensor(viewDims: *const i64, viewDimsNum: u64, dataType: aclDataType, stride: *const i64, offset: i64, format: aclFormat, storageDims: *const i64, storageDimsNum: u64, tensorData: *mut c_void) -> *mut aclTensor;
                fn aclDestroyTensor(tensor: *const aclTensor) -> aclnnStatus;
                fn aclCreateScalar(value: *mut c_void, dataType: aclDataType) -> *mut aclScalar;
                fn aclDestroyScalar(scalar: *const aclScalar) -> aclnnStatus;
                fn aclCreateIntArray(value: *const i64, size: u64) -> *mut aclIntArray;
                fn aclDestroyIntArray(array: *const aclIntArray) -> aclnnStatus;
                fn aclCreateTensorList(value: *const *const aclTensor, size: u64) -> *mut aclTensorList;
                fn aclDestroyTensorList(array: *const aclTensorList) -> aclnnStatus;
            }
            optional {
                fn aclSetAclOpExecutorRepeatable(executor: *mut aclOpExecutor) -> aclnnStatus;
                fn aclDestroyAclOpExecutor(executor: *mut aclOpExecutor) -> aclnnStatus;
                fn aclSetInputTensorAddr(executor: *mut aclOpExecutor, index: usize, tensor: *mut aclTensor, addr: *mut c_void) -> aclnnStatus;
                fn aclSetOutputTensorAddr(executor: *mut aclOpExecutor, index: usize, tensor: *mut aclTensor, addr: *mut c_void) -> aclnnStatus;
            }
        }
    }
}

/// The operators, resolved from `libopapi.so` (and the split `libopapi_*.so` where present).
pub mod ops {
    use super::*;
    crate::api_table! {
        /// The aclnn operators of one Llama step, each a documented two-phase pair.
        pub struct AclnnOpsApi ("libopapi.so, libopapi_transformer.so, libopapi_nn.so, libopapi_math.so") {
            required {
                fn aclnnAddGetWorkspaceSize(self_: *const aclTensor, other: *const aclTensor, alpha: *const aclScalar, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnAdd(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnInplaceAddGetWorkspaceSize(selfRef: *const aclTensor, other: *const aclTensor, alpha: *const aclScalar, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnInplaceAdd(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnCastGetWorkspaceSize(self_: *const aclTensor, dtype: aclDataType, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnCast(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnInplaceCopyGetWorkspaceSize(selfRef: *mut aclTensor, src: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnInplaceCopy(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnNanToNumGetWorkspaceSize(self_: *const aclTensor, nan: f32, posinf: f32, neginf: f32, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnNanToNum(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnLogSoftmaxGetWorkspaceSize(self_: *const aclTensor, dim: i64, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnLogSoftmax(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnGatherGetWorkspaceSize(self_: *const aclTensor, dim: i64, index: *const aclTensor, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnGather(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnMulGetWorkspaceSize(self_: *const aclTensor, other: *const aclTensor, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnMul(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnDynamicQuantGetWorkspaceSize(x: *const aclTensor, smoothScalesOptional: *const aclTensor, yOut: *const aclTensor, scaleOut: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnDynamicQuant(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnRmsNormGetWorkspaceSize(x: *const aclTensor, gamma: *const aclTensor, epsilon: f64, yOut: *const aclTensor, rstdOut: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnRmsNorm(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnSwiGluGetWorkspaceSize(x: *const aclTensor, dim: i64, out: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnSwiGlu(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnEmbeddingGetWorkspaceSize(weight: *const aclTensor, indices: *const aclTensor, out: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnEmbedding(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnArgMaxGetWorkspaceSize(self_: *const aclTensor, dim: i64, keepdim: bool, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnArgMax(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnMatmulGetWorkspaceSize(self_: *const aclTensor, mat2: *const aclTensor, out: *mut aclTensor, cubeMathType: i8, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnMatmul(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnWeightQuantBatchMatmulV2GetWorkspaceSize(x: *const aclTensor, weight: *const aclTensor, antiquantScale: *const aclTensor, antiquantOffsetOptional: *const aclTensor, quantScaleOptional: *const aclTensor, quantOffsetOptional: *const aclTensor, biasOptional: *const aclTensor, antiquantGroupSize: c_int, y: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnWeightQuantBatchMatmulV2(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnFusedInferAttentionScoreV2GetWorkspaceSize(query: *const aclTensor, key: *const aclTensorList, value: *const aclTensorList, pseShiftOptional: *const aclTensor, attenMaskOptional: *const aclTensor, actualSeqLengthsOptional: *const aclIntArray, actualSeqLengthsKvOptional: *const aclIntArray, deqScale1Optional: *const aclTensor, quantScale1Optional: *const aclTensor, deqScale2Optional: *const aclTensor, quantScale2Optional: *const aclTensor, quantOffset2Optional: *const aclTensor, antiquantScaleOptional: *const aclTensor, antiquantOffsetOptional: *const aclTensor, blockTableOptional: *const aclTensor, queryPaddingSizeOptional: *const aclTensor, kvPaddingSizeOptional: *const aclTensor, keyAntiquantScaleOptional: *const aclTensor, keyAntiquantOffsetOptional: *const aclTensor, valueAntiquantScaleOptional: *const aclTensor, valueAntiquantOffsetOptional: *const aclTensor, keySharedPrefixOptional: *const aclTensor, valueSharedPrefixOptional: *const aclTensor, actualSharedPrefixLenOptional: *const aclIntArray, numHeads: i64, scaleValue: f64, preTokens: i64, nextTokens: i64, inputLayout: *mut c_char, numKeyValueHeads: i64, sparseMode: i64, innerPrecise: i64, blockSize: i64, antiquantMode: i64, softmaxLseFlag: bool, keyAntiquantMode: i64, valueAntiquantMode: i64, attentionOut: *const aclTensor, softmaxLse: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnFusedInferAttentionScoreV2(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnScatterNdUpdateGetWorkspaceSize(varRef: *mut aclTensor, indices: *const aclTensor, updates: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnScatterNdUpdate(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnApplyRotaryPosEmbGetWorkspaceSize(queryRef: *mut aclTensor, keyRef: *mut aclTensor, cos: *const aclTensor, sin: *const aclTensor, layout: i64, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnApplyRotaryPosEmb(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
            }
            optional {
                fn aclnnRotaryPositionEmbeddingGetWorkspaceSize(x: *const aclTensor, cos: *const aclTensor, sin: *const aclTensor, mode: i64, out: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnRotaryPositionEmbedding(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnScatterPaKvCacheGetWorkspaceSize(key: *const aclTensor, keyCacheRef: *mut aclTensor, slotMapping: *const aclTensor, value: *const aclTensor, valueCacheRef: *mut aclTensor, compressLensOptional: *const aclTensor, compressSeqOffsetOptional: *const aclTensor, seqLensOptional: *const aclTensor, cacheModeOptional: *mut c_char, scatterModeOptional: *mut c_char, stridesOptional: *const aclIntArray, offsetsOptional: *const aclIntArray, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnScatterPaKvCache(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnGeluV2GetWorkspaceSize(x: *const aclTensor, approximate: i64, y: *mut aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnGeluV2(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnInplaceMulGetWorkspaceSize(selfRef: *mut aclTensor, other: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnInplaceMul(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnInplaceMulsGetWorkspaceSize(selfRef: *mut aclTensor, other: *const aclScalar, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnInplaceMuls(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnAddRmsNormGetWorkspaceSize(x1: *const aclTensor, x2: *const aclTensor, gamma: *const aclTensor, epsilon: f64, yOut: *const aclTensor, rstdOut: *const aclTensor, xOut: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnAddRmsNorm(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnMoeGatingTopKSoftmaxV2GetWorkspaceSize(x: *const aclTensor, finishedOptional: *const aclTensor, k: i64, renorm: i64, outputSoftmaxResultFlag: bool, yOut: *const aclTensor, expertIdxOut: *const aclTensor, softmaxResultOutOptional: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnMoeGatingTopKSoftmaxV2(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnMoeFinalizeRoutingV2GetWorkspaceSize(expandedX: *const aclTensor, expandedRowIdx: *const aclTensor, x1Optional: *const aclTensor, x2Optional: *const aclTensor, biasOptional: *const aclTensor, scalesOptional: *const aclTensor, expertIdxOptional: *const aclTensor, dropPadMode: i64, out: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnMoeFinalizeRoutingV2(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnMoeInitRoutingV2GetWorkspaceSize(x: *const aclTensor, expertIdx: *const aclTensor, activeNum: i64, expertCapacity: i64, expertNum: i64, dropPadMode: i64, expertTokensCountOrCumsumFlag: i64, expertTokensBeforeCapacityFlag: bool, expandedXOut: *const aclTensor, expandedRowIdxOut: *const aclTensor, expertTokensCountOrCumsumOut: *const aclTensor, expertTokensBeforeCapacityOut: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnMoeInitRoutingV2(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnMoeGatingTopKGetWorkspaceSize(x: *const aclTensor, biasOptional: *const aclTensor, k: i64, kGroup: i64, groupCount: i64, groupSelectMode: i64, renorm: i64, normType: i64, outFlag: bool, routedScalingFactor: f64, eps: f64, yOut: *const aclTensor, expertIdxOut: *const aclTensor, outOut: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnMoeGatingTopK(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnGroupedMatmulV4GetWorkspaceSize(x: *const aclTensorList, weight: *const aclTensorList, biasOptional: *const aclTensorList, scaleOptional: *const aclTensorList, offsetOptional: *const aclTensorList, antiquantScaleOptional: *const aclTensorList, antiquantOffsetOptional: *const aclTensorList, perTokenScaleOptional: *const aclTensorList, groupListOptional: *const aclTensor, activationInputOptional: *const aclTensorList, activationQuantScaleOptional: *const aclTensorList, activationQuantOffsetOptional: *const aclTensorList, splitItem: i64, groupType: i64, groupListType: i64, actType: i64, out: *mut aclTensorList, activationFeatureOutOptional: *mut aclTensorList, dynQuantScaleOutOptional: *mut aclTensorList, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnGroupedMatmulV4(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnFusedInferAttentionScoreV3GetWorkspaceSize(query: *const aclTensor, key: *const aclTensorList, value: *const aclTensorList, pseShiftOptional: *const aclTensor, attenMaskOptional: *const aclTensor, actualSeqLengthsOptional: *const aclIntArray, actualSeqLengthsKvOptional: *const aclIntArray, deqScale1Optional: *const aclTensor, quantScale1Optional: *const aclTensor, deqScale2Optional: *const aclTensor, quantScale2Optional: *const aclTensor, quantOffset2Optional: *const aclTensor, antiquantScaleOptional: *const aclTensor, antiquantOffsetOptional: *const aclTensor, blockTableOptional: *const aclTensor, queryPaddingSizeOptional: *const aclTensor, kvPaddingSizeOptional: *const aclTensor, keyAntiquantScaleOptional: *const aclTensor, keyAntiquantOffsetOptional: *const aclTensor, valueAntiquantScaleOptional: *const aclTensor, valueAntiquantOffsetOptional: *const aclTensor, keySharedPrefixOptional: *const aclTensor, valueSharedPrefixOptional: *const aclTensor, actualSharedPrefixLenOptional: *const aclIntArray, queryRopeOptional: *const aclTensor, keyRopeOptional: *const aclTensor, keyRopeAntiquantScaleOptional: *const aclTensor, numHeads: i64, scaleValue: f64, preTokens: i64, nextTokens: i64, inputLayout: *mut c_char, numKeyValueHeads: i64, sparseMode: i64, innerPrecise: i64, blockSize: i64, antiquantMode: i64, softmaxLseFlag: bool, keyAntiquantMode: i64, valueAntiquantMode: i64, attentionOut: *const aclTensor, softmaxLse: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnFusedInferAttentionScoreV3(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnMatmulAllReduceGetWorkspaceSize(x1: *const aclTensor, x2: *const aclTensor, bias: *const aclTensor, group: *const c_char, reduceOp: *const c_char, commTurn: i64, streamMode: i64, output: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnMatmulAllReduce(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
                fn aclnnWeightQuantMatmulAllReduceGetWorkspaceSize(x1: *const aclTensor, x2: *const aclTensor, bias: *const aclTensor, antiquantScale: *const aclTensor, antiquantOffset: *const aclTensor, x3: *const aclTensor, group: *const c_char, reduceOp: *const c_char, commTurn: i64, streamMode: i64, antiquantGroupSize: i64, output: *const aclTensor, workspaceSize: *mut u64, executor: *mut *mut aclOpExecutor) -> aclnnStatus;
                fn aclnnWeightQuantMatmulAllReduce(workspace: *mut c_void, workspaceSize: u64, executor: *mut aclOpExecutor, stream: aclrtStream) -> aclnnStatus;
            }
        }
    }
}
