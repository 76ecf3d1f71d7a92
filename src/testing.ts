/**
 * swactor's test doubles and harnesses (the package's "./testing" entry, `import … from "swactor/testing"`), for code
 * that tests itself against swactor; none of them is in the main entry.
 *
 * - `OrchestratorHarness`: a run actor (RunFsm) to feed events to and read commands from, with TestClock time;
 * - `StageExecutorTest`: a deterministic StageExecutor (`layer`, `layerWith(model)`, its test model's greedy tokens);
 * - `TokenizerTest`: a byte tokenizer (token 1 = BOS, 2 = EOS, 3 + each UTF-8 byte) and the Tokenizer layer giving it;
 * - `ModelCatalogTest`: a ModelCatalog layer answering from a table of facts and layouts;
 * - `AgentLinksTest`: an in-memory data plane and a world of in-process agents (links that can be killed);
 * - `Synthetic`: writers of small synthetic GGUF models of every supported architecture;
 * - `testLinearPlan`: a linear run plan over given stages.
 */
import * as ModelCatalogLive from "./layers/gguf/ModelCatalogLive.js"
import * as TokenizerLive from "./layers/gguf/TokenizerLive.js"

export { OrchestratorHarness } from "./services/OrchestratorHarness.js"
export * as StageExecutorTest from "./layers/engine/StageExecutorTest.js"
export * as AgentLinksTest from "./layers/agent/AgentLinksTest.js"
export * as Synthetic from "./layers/gguf/Synthetic.js"
export { testLinearPlan, type StageRef } from "./services/Planner.js"

/** The tokenizer's test double: `layer` provides `Tokenizer` with `byteTokenizer` for every model path. */
export const TokenizerTest = { layer: TokenizerLive.layerTest, byteTokenizer: TokenizerLive.byteTokenizer } as const

/** The model catalog's test double: `layer(models, layouts?)` answers from the tables, any other path fails. */
export const ModelCatalogTest = { layer: ModelCatalogLive.layerTest } as const
