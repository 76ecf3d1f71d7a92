// The layering of src/ (see README and /work/shared/DESIGN.md), checked by `npm run lint:deps`:
//   domain (pure values) <- services (tags, contracts, pure logic) <- layers (live and test implementations)
//   <- api (the library's functions) <- cli, main.ts and index.ts (the program and the library entry compose layers)
// An arrow points from what is used to its user: a module may import from its own folder or any folder to its left.
/** @type {import("dependency-cruiser").IConfiguration} */
module.exports = {
  forbidden: [
    {
      name: "no-circular",
      severity: "error",
      comment: "A cycle means two modules cannot be understood, tested or moved apart.",
      from: { path: "^src/" },
      to: { circular: true }
    },
    {
      name: "domain-imports-no-node-builtins",
      severity: "error",
      comment: "src/domain holds plain values and schemas: no I/O.",
      from: { path: "^src/domain/" },
      to: { dependencyTypes: ["core"] }
    },
    {
      name: "domain-types-stay-in-domain",
      severity: "error",
      comment: "Even type-only imports from the domain point down only.",
      from: { path: "^src/domain/" },
      to: { path: ["^src/(services|layers|api|cli)/", "^src/(main|index)\\.ts$"] }
    },
    {
      name: "services-above-domain-only",
      severity: "error",
      comment: "Services (tags and contracts) may use the domain, never an implementation, the api or the CLI.",
      from: { path: "^src/services/" },
      to: { path: ["^src/(layers|api|cli)/", "^src/(main|index)\\.ts$"] }
    },
    {
      name: "layers-below-api",
      severity: "error",
      comment: "Implementations may use services and the domain, never the api or the CLI.",
      from: { path: "^src/layers/" },
      to: { path: ["^src/(api|cli)/", "^src/(main|index)\\.ts$"] }
    },
    {
      name: "api-below-cli",
      severity: "error",
      from: { path: "^src/api/" },
      to: { path: ["^src/cli/", "^src/(main|index)\\.ts$"] }
    },
    {
      name: "cli-not-from-library-entry",
      severity: "error",
      comment: "The CLI composes layers itself; the library entry is for users of the package.",
      from: { path: "^src/cli/" },
      to: { path: "^src/(main|index)\\.ts$" }
    },
    {
      name: "no-unresolvable",
      severity: "error",
      from: { path: "^src/" },
      to: { couldNotResolve: true }
    }
  ],
  options: {
    doNotFollow: { path: "node_modules" },
    tsPreCompilationDeps: true,
    tsConfig: { fileName: "tsconfig.json" },
    enhancedResolveOptions: { exportsFields: ["exports"], conditionNames: ["import", "require", "node", "default"] }
  }
}
