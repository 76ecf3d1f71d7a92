// node-llama-cpp's greedy run on its CPU build for this process's platform, in a process of its own (test/arm64 runs it
// under qemu-aarch64, where it loads @node-llama-cpp/linux-arm64): node cpuReference.mjs MODEL PROMPT N -> one JSON
// line {arch, gpu, prompt, tokens}. Several files and prompts in one process (under qemu most of a run is node-llama-
// cpp's start): node cpuReference.mjs '{"runs": [{"model", "prompt"}], "n"}' -> {arch, gpu, cpuBackend, runs: [{prompt,
// tokens}]}, each run in a fresh context, cpuBackend the libggml-cpu variant(s) loaded. Flash attention on, F16 KV, one
// thread, a 256-token context: the settings swactor's side runs with. Under qemu-user without binfmt_misc, a child of
// this process cannot exec the arm64 Node binary: with SWACTOR_TEST_QEMU="QEMU SYSROOT", node-llama-cpp's binding test
// process (child_process.fork) is started through qemu as well.
import childProcess from "node:child_process"
import { readFileSync } from "node:fs"
import { syncBuiltinESMExports } from "node:module"
import { greedy } from "./greedyReference.mjs"

const qemu = process.env["SWACTOR_TEST_QEMU"]
if (qemu !== undefined && qemu !== "") {
  const [qemuPath, sysroot] = qemu.split(" ")
  const fork = childProcess.fork
  childProcess.fork = (modulePath, args, options) =>
    fork(modulePath, args, {
      ...options,
      execPath: qemuPath,
      execArgv: ["-L", sysroot, process.execPath, ...(options?.execArgv ?? process.execArgv)]
    })
  syncBuiltinESMExports()
}
const { getLlama, LlamaLogLevel } = await import("node-llama-cpp")

const llama = await getLlama({ gpu: false, build: "never", logLevel: LlamaLogLevel.error })

const args = process.argv.slice(2)
if (args[0]?.startsWith("{")) {
  const job = JSON.parse(args[0])
  const runs = []
  for (const run of job.runs) {
    const model = await llama.loadModel({ modelPath: run.model })
    runs.push(await greedy(model, run.prompt, job.n))
    await model.dispose()
  }
  // the CPU backend variant ggml loaded for this CPU (libggml-cpu-<variant>.so)
  const cpuBackend = [
    ...new Set(
      readFileSync("/proc/self/maps", "utf8")
        .split("\n")
        .map((line) => line.split(/\s+/).at(-1) ?? "")
        .filter((path) => /libggml-cpu[^/]*\.so$/.test(path))
    )
  ]
  console.log(JSON.stringify({ arch: process.arch, gpu: llama.gpu, cpuBackend, runs }))
} else {
  const [path, text, count] = args
  const model = await llama.loadModel({ modelPath: path })
  const { prompt, tokens } = await greedy(model, text, Number(count))
  console.log(JSON.stringify({ arch: process.arch, gpu: llama.gpu, prompt, tokens }))
  await model.dispose()
}
await llama.dispose()
