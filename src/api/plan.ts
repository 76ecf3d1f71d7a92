/**
 * Planning, the library's `Plan` namespace: the ids a plan names (domain/ids.ts), the plan itself and the planner's
 * input (domain/plan.ts), the planner (`planRun`, `deriveStageProvision`, ...) and its typed rejections. The
 * planner's test plans (`testLinearPlan`) are in the `swactor/testing` entry.
 */
export * from "../domain/ids.js"
export * from "../domain/plan.js"
export * from "../domain/planErrors.js"
export {
  activationFrameBytes,
  deriveStageProvision,
  deriveStageProvisionEither,
  formatLayerRanges,
  INPUT_PORT,
  layerRangesProblem,
  OUTPUT_PORT,
  partitionLayers,
  planRun,
  planRunEither,
  stageNodes
} from "../services/Planner.js"
