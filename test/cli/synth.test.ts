import * as Command from "@effect/cli/Command"
import * as NodeContext from "@effect/platform-node/NodeContext"
import { assert, describe, it } from "@effect/vitest"
import { Effect, Exit } from "effect"
import { existsSync, mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import { synthCommand } from "../../src/cli/SynthCommand.js"
import { GgmlType } from "../../src/domain/ggmlTypes.js"
import { getString, getU32, readGgufFile } from "../../src/layers/gguf/GgufReader.js"

const dir = mkdtempSync(join(tmpdir(), "swactor-synth-cli-"))
afterAll(() => rmSync(dir, { recursive: true, force: true }))

const cli = Command.run(Command.make("swactor").pipe(Command.withSubcommands([synthCommand])), {
  name: "swactor",
  version: "test"
})
const run = (args: ReadonlyArray<string>) =>
  cli(["node", "swactor", "synth", ...args]).pipe(Effect.provide(NodeContext.layer), Effect.exit)

describe("swactor synth", () => {
  // The command line of the brief writes the model it describes.
  it.live("writes the model its flags describe", () =>
    Effect.gen(function* () {
      const out = join(dir, "cli.gguf")
      const exit = yield* run([
        "--arch",
        "qwen2",
        "--layers",
        "3",
        "--hidden",
        "64",
        "--ffn",
        "128",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "--vocab",
        "300",
        "--type",
        "q8_0",
        "--seed",
        "5",
        "--context-length",
        "512",
        "--tied-output",
        "-o",
        out
      ])
      assert.isTrue(Exit.isSuccess(exit))
      const file = yield* readGgufFile(out)
      assert.strictEqual(yield* getString(file, "general.architecture"), "qwen2")
      assert.strictEqual(yield* getU32(file, "qwen2.block_count"), 3)
      assert.strictEqual(yield* getU32(file, "qwen2.feed_forward_length"), 128)
      assert.strictEqual(yield* getU32(file, "qwen2.context_length"), 512)
      assert.isFalse(file.tensorsByName.has("output.weight"))
      assert.strictEqual(file.tensorsByName.get("blk.2.ffn_up.weight")?.type, GgmlType.Q8_0)
    })
  )

  // Impossible shapes fail (non-zero exit) and write nothing.
  it.live("rejects impossible shapes without writing", () =>
    Effect.gen(function* () {
      const out = join(dir, "bad.gguf")
      const exit = yield* run([
        "--layers",
        "1",
        "--hidden",
        "63",
        "--ffn",
        "128",
        "--heads",
        "4",
        "--kv-heads",
        "2",
        "-o",
        out
      ])
      assert.isTrue(Exit.isFailure(exit))
      assert.isFalse(existsSync(out))
    })
  )
})
