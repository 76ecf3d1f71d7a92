/**
 * Naming rule of the architecture issue: no two exported things in src/ share a name (a Schema and its type of the
 * same name are one thing; the per-module `make`, `layer` and `layerTest` of Effect's own packages are meant to
 * repeat, always used through their module). A second `generate`, `alignUp` or `StagePlan` fails here.
 */
import { readdirSync, readFileSync } from "node:fs"
import { join, relative } from "node:path"
import { describe, expect, it } from "vitest"

const root = join(import.meta.dirname, "..", "src")
const files = (dir: string): Array<string> =>
  readdirSync(dir, { withFileTypes: true }).flatMap((e) =>
    e.isDirectory() ? files(join(dir, e.name)) : e.name.endsWith(".ts") ? [join(dir, e.name)] : []
  )
const idiom = new Set(["make", "layer", "layerTest"])

/** name -> modules declaring it (export const/let/function/class, export interface/type). */
const declared = (): Map<string, Set<string>> => {
  const byName = new Map<string, Set<string>>()
  for (const file of files(root)) {
    const text = readFileSync(file, "utf8")
    for (const m of text.matchAll(/^export (?:declare )?(?:const|let|function|class|interface|type|enum) ([A-Za-z0-9_$]+)/gm)) {
      const name = m[1]!
      if (idiom.has(name)) continue
      const set = byName.get(name) ?? new Set<string>()
      set.add(relative(root, file))
      byName.set(name, set)
    }
  }
  return byName
}

describe("exported names", () => {
  it("the scan sees the project's exports (a Schema with its type counts once)", () => {
    const names = declared()
    expect(names.size).toBeGreaterThan(200)
    expect([...names.get("RunPlan") ?? []]).toEqual(["domain/plan.ts"])
    expect(names.get("alignUp")?.size).toBe(1)
  })

  it("no two modules export the same name", () => {
    const twice = [...declared()].filter(([, mods]) => mods.size > 1).map(([n, mods]) => `${n}: ${[...mods].join(", ")}`)
    expect(twice).toEqual([])
  })
})
