/** The supported architectures: adding one is a module under archs/ and one entry here. */
import type { ArchModule } from "./Arch.js"
import { deepseek2 } from "./archs/deepseek2.js"
import { deepseek4 } from "./archs/deepseek4.js"
import { deepseek32, glmDsa } from "./archs/dsa.js"
import { gemma3 } from "./archs/gemma3.js"
import { gemma4 } from "./archs/gemma4.js"
import { glm4moe } from "./archs/glm4moe.js"
import { gptOss } from "./archs/gptOss.js"
import { kimiK3 } from "./archs/kimiK3.js"
import { llama } from "./archs/llama.js"
import { minimaxM2 } from "./archs/minimaxM2.js"
import { mistral3 } from "./archs/mistral3.js"
import { olmo2 } from "./archs/olmo2.js"
import { qwen2 } from "./archs/qwen2.js"
import { qwen3 } from "./archs/qwen3.js"
import { qwen35 } from "./archs/qwen35.js"
import { qwen35moe } from "./archs/qwen35moe.js"
import { qwen3moe } from "./archs/qwen3moe.js"

export const architectures: ReadonlyMap<string, ArchModule> = new Map([
  ["llama", llama],
  ["qwen2", qwen2],
  ["qwen3", qwen3],
  ["qwen3moe", qwen3moe],
  ["qwen35", qwen35],
  ["qwen35moe", qwen35moe],
  ["glm4moe", glm4moe],
  ["deepseek2", deepseek2],
  ["deepseek32", deepseek32],
  ["glm-dsa", glmDsa],
  ["deepseek4", deepseek4],
  ["kimi-k3", kimiK3],
  ["gemma3", gemma3],
  ["gemma4", gemma4],
  ["mistral3", mistral3],
  ["gpt-oss", gptOss],
  ["minimax-m2", minimaxM2],
  ["olmo2", olmo2]
])

export const supportedArchitectures = (): ReadonlyArray<string> => [...architectures.keys()]
