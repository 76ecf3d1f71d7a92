// node-llama-cpp's greedy run on its Vulkan build (its CUDA build when SWACTOR_GPU_TEST_BACKEND=cuda, as
// test/support/gpuTarget.ts), in a process of its own (the test process holds the CPU build):
// node vulkanReference.mjs MODEL PROMPT N [GPU_LAYERS] -> one JSON line {gpu, prompt, tokens}. GPU_LAYERS (default
// max): llama.cpp's -ngl, the last GPU_LAYERS - 1 blocks and the output head on the device, the rest on the CPU. Flash attention on, F16 KV, one
// thread, a 256-token context: the settings swactor's side runs with. The device is the environment's
// (GGML_VK_VISIBLE_DEVICES, VK_ICD_FILENAMES; CUDA_VISIBLE_DEVICES), as for swactor's agents.
import { getLlama, LlamaLogLevel } from "node-llama-cpp"
import { greedy } from "./greedyReference.mjs"

const [path, text, count, layers] = process.argv.slice(2)
const gpu = process.env.SWACTOR_GPU_TEST_BACKEND === "cuda" ? "cuda" : "vulkan"
const llama = await getLlama({ gpu, build: "never", logLevel: LlamaLogLevel.error })
const model = await llama.loadModel({ modelPath: path, gpuLayers: layers === undefined ? "max" : Number(layers) })
const { prompt, tokens } = await greedy(model, text, Number(count))
console.log(JSON.stringify({ gpu: llama.gpu, prompt, tokens }))
await model.dispose()
await llama.dispose()
