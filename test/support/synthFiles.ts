/** What the engine tests on synthetic model files share: a temporary folder per test file, the prompt, run settings. */
import { mkdtempSync, rmSync } from "node:fs"
import { tmpdir } from "node:os"
import { join } from "node:path"
import { afterAll } from "vitest"
import type { SyntheticModelOptions } from "../../src/layers/gguf/Synthetic.js"

/** The prompt the synthetic-model equivalence tests feed (long enough to cross a 16-token window). */
export const STORY_PROMPT =
  "Once upon a time there was a little girl who lived in a village near the forest with her mother"

/** Settings both sides of an equivalence test run with: one thread, a 256-token context. */
export const REFERENCE_OPTIONS = { threads: 1, contextLength: 256 } as const

/** A fresh temporary folder for this test file's models, removed after the file's tests. */
export const modelFolder = (prefix: string): string => {
  const dir = mkdtempSync(join(tmpdir(), prefix))
  afterAll(() => rmSync(dir, { recursive: true, force: true }))
  return dir
}

/**
 * A tiny gemma4 at `path`: 6 blocks, hidden 128, FFN 256, 4 query / 2 KV heads, vocabulary 400, F32, a 16-token
 * sliding window with every third block global; `extra` sets the rest (the layout a test is about).
 */
export const gemma4Model = (path: string, extra: Partial<SyntheticModelOptions> = {}): SyntheticModelOptions => ({
  path,
  arch: "gemma4",
  layers: 6,
  hidden: 128,
  ffn: 256,
  heads: 4,
  kvHeads: 2,
  vocab: 400,
  contextLength: 512,
  type: "f32",
  seed: 41,
  slidingWindow: 16,
  swaPattern: 3,
  ...extra
})
