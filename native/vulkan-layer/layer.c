/* VK_LAYER_GPUPPETTI_slice: a Vulkan implicit layer that makes a GPU slice look, and behave, like a GPU of the
 * slice's size to the processes of one container.
 *
 * - Only the container's GPUs are enumerated (matched by PCI bus address or device UUID).
 * - Every heap that counts is reported no larger than the budget; VK_EXT_memory_budget reports the budget (the
 *   layer adds the extension where the driver lacks it); maxMemoryAllocationSize and maxBufferSize are no larger.
 * - vkAllocateMemory reserves in the allocation's ledger, which the daemon keeps (ledger.h), before it calls down,
 *   and returns VK_ERROR_OUT_OF_DEVICE_MEMORY once the allocation's processes together would pass the budget (or
 *   once the daemon has been away for GPUPPETTI_VK_LEDGER_WAIT_MS). What a process holds is given back when it
 *   ends, however it ends: the daemon sees its connection close.
 *
 * - With a compute share (dutycycle.h), vkQueueSubmit and vkQueueSubmit2 wait while the slice has used more than
 *   its share of the GPU's time, or while the process has more of it queued, not yet charged, than the share bounds.
 *
 * What counts: on a discrete GPU, the device-local heaps (VRAM, and a resizable-BAR heap beside it); on an
 * integrated GPU, a CPU (lavapipe) or a virtual GPU (Venus), where every heap is the same memory, all of them.
 *
 * Memory that is exported (vkGetMemoryFdKHR) is charged once, to the exported object, for as long as some process of
 * the allocation holds a handle to it: its exporter until it frees it, and each process that imports it (an fd or a
 * dma-buf) until it frees its own; the object is known by the exported file's st_dev and st_ino. Other imported
 * memory (an object the ledger does not know, a host pointer) is someone else's and does not count.
 *
 * A forked child inherits its parent's records but not its connection: memory its parent allocated stays its
 * parent's, and the child freeing its copy of the handle gives nothing back.
 *
 * The layer never breaks an application: without its environment (slices.h) it passes every call through, except
 * that it answers for VK_EXT_memory_budget where the driver lacks it (the loader advertises the extension from the
 * layer's manifest either way). It has no fixed limit on instances, devices, GPUs or slices; where it runs out of
 * memory to track something it passes that through and says so once on stderr.
 * Only vkNegotiateLoaderLayerInterfaceVersion is exported; everything else is reached through it.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vulkan/vk_layer.h>
#include <vulkan/vulkan.h>

#include "dutycycle.h"
#include "handles.h"
#include "ledger.h"
#include "slices.h"
#include "spin.h"

#define EXPORT __attribute__((visibility("default")))
#define LAYER_NAME "VK_LAYER_GPUPPETTI_slice"

static void *dispatch_key(const void *handle)
{
    return *(void *const *)handle;
}

/* Said once per process on stderr: what the layer could not track, and so passed through. */
static void say_once(atomic_flag *said, const char *what)
{
    if (!atomic_flag_test_and_set(said)) {
        fprintf(stderr, "gpuppetti Vulkan layer: %s\n", what);
    }
}

/* -- instances, their physical devices, and devices ------------------------------------------------------- */

struct physical {
    VkPhysicalDevice handle;
    struct slice *slice; /* NULL: not the container's GPU */
    VkPhysicalDeviceType type;
    bool native_budget;  /* the driver has VK_EXT_memory_budget itself */
    bool budget_listed;  /* the list from below names it (the loader adds an implicit layer's manifest's) */
};

struct instance {
    void *key;
    VkInstance handle;
    uint32_t api_version;
    PFN_vkGetInstanceProcAddr gipa;
    PFN_vkDestroyInstance DestroyInstance;
    PFN_vkEnumeratePhysicalDevices EnumeratePhysicalDevices;
    PFN_vkEnumeratePhysicalDeviceGroups EnumeratePhysicalDeviceGroups;
    PFN_vkGetPhysicalDeviceProperties GetPhysicalDeviceProperties;
    PFN_vkGetPhysicalDeviceProperties2 GetPhysicalDeviceProperties2;
    PFN_vkGetPhysicalDeviceMemoryProperties GetPhysicalDeviceMemoryProperties;
    PFN_vkGetPhysicalDeviceMemoryProperties2 GetPhysicalDeviceMemoryProperties2;
    PFN_vkEnumerateDeviceExtensionProperties EnumerateDeviceExtensionProperties;
    bool learned; /* the physical devices are known: without that, nothing is hidden or emulated */
    int physical_count;
    struct physical *physicals;
};

struct device {
    void *key;
    PFN_vkGetDeviceProcAddr gdpa;
    PFN_vkDestroyDevice DestroyDevice;
    PFN_vkAllocateMemory AllocateMemory;
    PFN_vkFreeMemory FreeMemory;
    PFN_vkQueueSubmit QueueSubmit;
    PFN_vkQueueSubmit2 QueueSubmit2;
    PFN_vkQueueSubmit2KHR QueueSubmit2KHR;
    PFN_vkGetMemoryFdKHR GetMemoryFdKHR;
    struct duty *duty;               /* NULL: not throttled */
    struct slice *slice;             /* NULL or budget 0: nothing to count */
    int index;                       /* the slice's, in the ledger */
    uint32_t counted_heaps;          /* bit per heap whose allocations count */
    uint32_t type_heap[VK_MAX_MEMORY_TYPES];
};

static struct handle_map instances;
static struct handle_map devices;

static struct instance *instance_of(const void *handle)
{
    return handles_find(&instances, dispatch_key(handle));
}

static struct device *device_of(const void *handle)
{
    return handles_find(&devices, dispatch_key(handle));
}

/* -- allocations: each counted VkDeviceMemory, with its size and heap, until it is freed -------------------- */

#define BUCKETS 4096

struct allocation {
    struct allocation *next;
    uint64_t memory;
    struct device *device;
    int64_t size;
    uint32_t heap;
    unsigned forks; /* ledger_forks() when it was allocated: another value, an ancestor's */
    bool keyed;     /* exported or imported: it holds the object key (its free lets go of it) */
    struct ledger_key key;
};

/* Whether what an allocation counts is this process's to give back. */
static bool ours(const struct allocation *entry)
{
    return entry->forks == ledger_forks();
}

/* What an allocation of this process's held goes back: the object it holds, or its reservation. */
static void give_back(struct device *device, const struct allocation *entry)
{
    if (!ours(entry)) {
        return;
    }
    if (entry->keyed) {
        ledger_unhold(entry->key);
    } else {
        ledger_release(device->index, entry->heap, entry->size);
    }
}

static spin_t bucket_locks[BUCKETS];
static struct allocation *buckets[BUCKETS];

static uint32_t bucket_of(uint64_t memory)
{
    memory ^= memory >> 33;
    memory *= 0xff51afd7ed558ccdULL;
    memory ^= memory >> 33;
    return (uint32_t)(memory % BUCKETS);
}

static bool track(struct device *device, uint64_t memory, int64_t size, uint32_t heap, const struct ledger_key *key)
{
    struct allocation *entry = malloc(sizeof *entry);
    if (entry == NULL) {
        return false;
    }
    entry->memory = memory;
    entry->device = device;
    entry->size = size;
    entry->heap = heap;
    entry->forks = ledger_forks();
    entry->keyed = key != NULL;
    entry->key = key != NULL ? *key : (struct ledger_key){0, 0};
    uint32_t bucket = bucket_of(memory);
    spin_lock(&bucket_locks[bucket]);
    entry->next = buckets[bucket];
    buckets[bucket] = entry;
    spin_unlock(&bucket_locks[bucket]);
    return true;
}

static struct allocation *untrack(struct device *device, uint64_t memory)
{
    uint32_t bucket = bucket_of(memory);
    struct allocation *found = NULL;
    spin_lock(&bucket_locks[bucket]);
    for (struct allocation **link = &buckets[bucket]; *link != NULL; link = &(*link)->next) {
        if ((*link)->memory == memory && (*link)->device == device) {
            found = *link;
            *link = found->next;
            break;
        }
    }
    spin_unlock(&bucket_locks[bucket]);
    return found;
}

/* The first export of an allocation of this process's makes it an object of the ledger's (ledger.h): charged to the
 * object, held by this process until it frees it. */
static void mark_exported(struct device *device, uint64_t memory, struct ledger_key key)
{
    uint32_t bucket = bucket_of(memory);
    spin_lock(&bucket_locks[bucket]);
    for (struct allocation *entry = buckets[bucket]; entry != NULL; entry = entry->next) {
        if (entry->memory == memory && entry->device == device) {
            /* The ledger is told under the bucket's lock: a free of the same memory cannot come in between. */
            if (ours(entry) && !entry->keyed && ledger_export(device->index, entry->heap, entry->size, key)) {
                entry->keyed = true;
                entry->key = key;
            }
            break;
        }
    }
    spin_unlock(&bucket_locks[bucket]);
}

/* What a device that is destroyed without freeing its memory still held. */
static void untrack_device(struct device *device)
{
    for (uint32_t bucket = 0; bucket < BUCKETS; bucket++) {
        spin_lock(&bucket_locks[bucket]);
        struct allocation **link = &buckets[bucket];
        while (*link != NULL) {
            struct allocation *entry = *link;
            if (entry->device == device) {
                *link = entry->next;
                give_back(device, entry);
                free(entry);
            } else {
                link = &entry->next;
            }
        }
        spin_unlock(&bucket_locks[bucket]);
    }
}

/* -- which GPU is whose ----------------------------------------------------------------------------------- */

static bool has_extension(struct instance *instance, VkPhysicalDevice physical, const char *name)
{
    uint32_t count = 0;
    if (instance->EnumerateDeviceExtensionProperties(physical, NULL, &count, NULL) != VK_SUCCESS || count == 0) {
        return false;
    }
    VkExtensionProperties *properties = calloc(count, sizeof *properties);
    if (properties == NULL) {
        return false;
    }
    bool found = false;
    if (instance->EnumerateDeviceExtensionProperties(physical, NULL, &count, properties) >= VK_SUCCESS) {
        for (uint32_t i = 0; i < count && !found; i++) {
            found = strcmp(properties[i].extensionName, name) == 0;
        }
    }
    free(properties);
    return found;
}

/* The slice a physical device belongs to, matched by its PCI bus address or its UUID; NULL when it is not one of
 * the container's GPUs. A slice that selects "any" takes whatever device there is (a simulated GPU). */
static struct slice *match(struct instance *instance, VkPhysicalDevice physical, VkPhysicalDeviceType *type)
{
    const struct slices *slices = slices_get();
    VkPhysicalDeviceProperties basic;
    instance->GetPhysicalDeviceProperties(physical, &basic);
    *type = basic.deviceType;
    if (slices->count == 0) {
        return NULL;
    }
    bool pci_known = false, uuid_known = false;
    VkPhysicalDevicePCIBusInfoPropertiesEXT pci = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PCI_BUS_INFO_PROPERTIES_EXT};
    VkPhysicalDeviceIDProperties id = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_ID_PROPERTIES};
    if (instance->GetPhysicalDeviceProperties2 != NULL) {
        VkPhysicalDeviceProperties2 properties = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, .pNext = &id};
        if (has_extension(instance, physical, VK_EXT_PCI_BUS_INFO_EXTENSION_NAME)) {
            id.pNext = &pci;
            pci_known = true;
        }
        instance->GetPhysicalDeviceProperties2(physical, &properties);
        uuid_known = true;
    }
    for (int i = 0; i < slices->count; i++) {
        struct slice *slice = (struct slice *)&slices->items[i];
        switch (slice->kind) {
        case SELECT_ANY:
            return slice;
        case SELECT_PCI:
            if (pci_known && pci.pciDomain == slice->pci_domain && pci.pciBus == slice->pci_bus &&
                pci.pciDevice == slice->pci_device && pci.pciFunction == slice->pci_function) {
                return slice;
            }
            break;
        case SELECT_UUID:
            if (uuid_known && memcmp(id.deviceUUID, slice->uuid, VK_UUID_SIZE) == 0) {
                return slice;
            }
            break;
        }
    }
    return NULL;
}

static struct physical *physical_of(struct instance *instance, VkPhysicalDevice handle)
{
    for (int i = 0; i < instance->physical_count; i++) {
        if (instance->physicals[i].handle == handle) {
            return &instance->physicals[i];
        }
    }
    return NULL;
}

/* Whether the driver itself reports memory budgets. Its extension list cannot tell: under an implicit layer the
 * loader adds the extensions of the layer's manifest (this one's VK_EXT_memory_budget) to it. So ask: a driver
 * with the extension fills the structure in. */
static bool driver_has_budget(struct instance *instance, VkPhysicalDevice physical)
{
    if (instance->GetPhysicalDeviceMemoryProperties2 == NULL ||
        !has_extension(instance, physical, VK_EXT_MEMORY_BUDGET_EXTENSION_NAME)) {
        return false;
    }
    VkPhysicalDeviceMemoryBudgetPropertiesEXT budget = {
        .sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT};
    VkPhysicalDeviceMemoryProperties2 memory = {.sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_PROPERTIES_2,
                                                .pNext = &budget};
    instance->GetPhysicalDeviceMemoryProperties2(physical, &memory);
    for (uint32_t heap = 0; heap < memory.memoryProperties.memoryHeapCount; heap++) {
        if (budget.heapBudget[heap] != 0) {
            return true;
        }
    }
    return false;
}

static atomic_flag said_untracked_gpus;

/* Learn the driver's physical devices, whose they are, and whether the driver reports budgets itself. Called once
 * per instance, before any filtering; where it fails, nothing is hidden, limited or emulated for that instance. */
static void learn_physicals(struct instance *instance)
{
    VkPhysicalDevice *handles = NULL;
    uint32_t count = 0;
    VkResult result = VK_INCOMPLETE;
    /* A GPU that appears between the two calls makes the second one incomplete: ask again. */
    for (int attempt = 0; attempt < 4 && result == VK_INCOMPLETE; attempt++) {
        free(handles);
        handles = NULL;
        count = 0;
        result = instance->EnumeratePhysicalDevices(instance->handle, &count, NULL);
        if (result != VK_SUCCESS) {
            return;
        }
        handles = calloc(count ? count : 1, sizeof *handles);
        if (handles == NULL) {
            break;
        }
        result = instance->EnumeratePhysicalDevices(instance->handle, &count, handles);
    }
    struct physical *physicals = result == VK_SUCCESS ? calloc(count ? count : 1, sizeof *physicals) : NULL;
    if (physicals == NULL) {
        free(handles);
        if (result == VK_SUCCESS || handles == NULL) {
            say_once(&said_untracked_gpus, "out of memory learning the GPUs: this instance is not held to a slice");
        }
        return;
    }
    for (uint32_t i = 0; i < count; i++) {
        physicals[i].handle = handles[i];
        physicals[i].slice = match(instance, handles[i], &physicals[i].type);
        physicals[i].native_budget = driver_has_budget(instance, handles[i]);
        physicals[i].budget_listed = has_extension(instance, handles[i], VK_EXT_MEMORY_BUDGET_EXTENSION_NAME);
    }
    free(handles);
    instance->physicals = physicals;
    instance->physical_count = (int)count;
    instance->learned = true;
}

/* A physical device the container may see: every one where the layer is not active. */
static bool visible(struct instance *instance, VkPhysicalDevice handle)
{
    if (!slices_get()->active || !instance->learned) {
        return true;
    }
    struct physical *physical = physical_of(instance, handle);
    return physical == NULL || physical->slice != NULL;
}

static int64_t budget_of(const struct physical *physical)
{
    return physical != NULL && physical->slice != NULL ? physical->slice->budget : 0;
}

/* Heaps that are the GPU's memory: all of them where the GPU shares the host's (integrated, CPU, virtual), the
 * device-local ones on a discrete GPU. */
static uint32_t counted_heaps(VkPhysicalDeviceType type, const VkPhysicalDeviceMemoryProperties *memory)
{
    uint32_t mask = 0;
    for (uint32_t heap = 0; heap < memory->memoryHeapCount && heap < LEDGER_HEAPS; heap++) {
        bool local = (memory->memoryHeaps[heap].flags & VK_MEMORY_HEAP_DEVICE_LOCAL_BIT) != 0;
        if (local || type != VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU) {
            mask |= 1u << heap;
        }
    }
    return mask;
}

/* -- the instance: creation, physical devices, their properties -------------------------------------------- */

static VkLayerInstanceCreateInfo *instance_link(const VkInstanceCreateInfo *info)
{
    for (const VkBaseInStructure *next = info->pNext; next != NULL; next = next->pNext) {
        if (next->sType == VK_STRUCTURE_TYPE_LOADER_INSTANCE_CREATE_INFO &&
            ((const VkLayerInstanceCreateInfo *)next)->function == VK_LAYER_LINK_INFO) {
            return (VkLayerInstanceCreateInfo *)next;
        }
    }
    return NULL;
}

static VkLayerDeviceCreateInfo *device_link(const VkDeviceCreateInfo *info)
{
    for (const VkBaseInStructure *next = info->pNext; next != NULL; next = next->pNext) {
        if (next->sType == VK_STRUCTURE_TYPE_LOADER_DEVICE_CREATE_INFO &&
            ((const VkLayerDeviceCreateInfo *)next)->function == VK_LAYER_LINK_INFO) {
            return (VkLayerDeviceCreateInfo *)next;
        }
    }
    return NULL;
}

static PFN_vkVoidFunction either(PFN_vkGetInstanceProcAddr gipa, VkInstance instance, const char *core,
                                 const char *khr)
{
    PFN_vkVoidFunction function = gipa(instance, core);
    return function != NULL ? function : gipa(instance, khr);
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_CreateInstance(const VkInstanceCreateInfo *info,
                                                           const VkAllocationCallbacks *allocator,
                                                           VkInstance *out)
{
    VkLayerInstanceCreateInfo *link = instance_link(info);
    if (link == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    PFN_vkCreateInstance create = (PFN_vkCreateInstance)gipa(VK_NULL_HANDLE, "vkCreateInstance");
    if (create == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    link->u.pLayerInfo = link->u.pLayerInfo->pNext;
    VkResult result = create(info, allocator, out);
    if (result != VK_SUCCESS) {
        return result;
    }
    struct instance *instance = calloc(1, sizeof *instance);
    PFN_vkDestroyInstance destroy = (PFN_vkDestroyInstance)gipa(*out, "vkDestroyInstance");
    if (instance == NULL) {
        /* Without its record the layer could not even pass the instance's calls down. */
        destroy(*out, allocator);
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    instance->key = dispatch_key(*out);
    instance->handle = *out;
    instance->api_version = info->pApplicationInfo != NULL ? info->pApplicationInfo->apiVersion : VK_API_VERSION_1_0;
    instance->gipa = gipa;
#define NEXT(name) (PFN_vk##name) gipa(*out, "vk" #name)
    instance->DestroyInstance = NEXT(DestroyInstance);
    instance->EnumeratePhysicalDevices = NEXT(EnumeratePhysicalDevices);
    instance->GetPhysicalDeviceProperties = NEXT(GetPhysicalDeviceProperties);
    instance->GetPhysicalDeviceMemoryProperties = NEXT(GetPhysicalDeviceMemoryProperties);
    instance->EnumerateDeviceExtensionProperties = NEXT(EnumerateDeviceExtensionProperties);
#undef NEXT
    instance->EnumeratePhysicalDeviceGroups = (PFN_vkEnumeratePhysicalDeviceGroups)either(
        gipa, *out, "vkEnumeratePhysicalDeviceGroups", "vkEnumeratePhysicalDeviceGroupsKHR");
    instance->GetPhysicalDeviceProperties2 = (PFN_vkGetPhysicalDeviceProperties2)either(
        gipa, *out, "vkGetPhysicalDeviceProperties2", "vkGetPhysicalDeviceProperties2KHR");
    instance->GetPhysicalDeviceMemoryProperties2 = (PFN_vkGetPhysicalDeviceMemoryProperties2)either(
        gipa, *out, "vkGetPhysicalDeviceMemoryProperties2", "vkGetPhysicalDeviceMemoryProperties2KHR");
    learn_physicals(instance);
    if (!handles_put(&instances, instance->key, instance)) {
        free(instance->physicals);
        free(instance);
        destroy(*out, allocator);
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL layer_DestroyInstance(VkInstance handle, const VkAllocationCallbacks *allocator)
{
    if (handle == VK_NULL_HANDLE) {
        return;
    }
    struct instance *instance = instance_of(handle);
    if (instance == NULL) {
        return;
    }
    PFN_vkDestroyInstance destroy = instance->DestroyInstance;
    handles_drop(&instances, instance->key);
    free(instance->physicals);
    free(instance);
    destroy(handle, allocator);
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_EnumeratePhysicalDevices(VkInstance handle, uint32_t *count,
                                                                     VkPhysicalDevice *out)
{
    struct instance *instance = instance_of(handle);
    if (instance == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    if (!slices_get()->active || !instance->learned) {
        return instance->EnumeratePhysicalDevices(handle, count, out);
    }
    uint32_t kept = 0;
    VkResult result = VK_SUCCESS;
    for (int i = 0; i < instance->physical_count; i++) {
        if (instance->physicals[i].slice == NULL) {
            continue;
        }
        if (out != NULL) {
            if (kept >= *count) {
                result = VK_INCOMPLETE;
                break;
            }
            out[kept] = instance->physicals[i].handle;
        }
        kept++;
    }
    *count = kept;
    return result;
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_EnumeratePhysicalDeviceGroups(VkInstance handle, uint32_t *count,
                                                                          VkPhysicalDeviceGroupProperties *out)
{
    struct instance *instance = instance_of(handle);
    if (instance == NULL || instance->EnumeratePhysicalDeviceGroups == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    if (!slices_get()->active) {
        return instance->EnumeratePhysicalDeviceGroups(handle, count, out);
    }
    uint32_t total = 0;
    VkResult result = instance->EnumeratePhysicalDeviceGroups(handle, &total, NULL);
    if (result != VK_SUCCESS) {
        return result;
    }
    VkPhysicalDeviceGroupProperties *groups = calloc(total ? total : 1, sizeof *groups);
    if (groups == NULL) {
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    for (uint32_t i = 0; i < total; i++) {
        groups[i].sType = VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_GROUP_PROPERTIES;
    }
    result = instance->EnumeratePhysicalDeviceGroups(handle, &total, groups);
    uint32_t kept = 0;
    if (result >= VK_SUCCESS) {
        result = VK_SUCCESS;
        for (uint32_t i = 0; i < total; i++) {
            VkPhysicalDeviceGroupProperties group = groups[i];
            uint32_t members = 0;
            for (uint32_t j = 0; j < group.physicalDeviceCount; j++) {
                if (visible(instance, group.physicalDevices[j])) {
                    group.physicalDevices[members++] = group.physicalDevices[j];
                }
            }
            if (members == 0) {
                continue;
            }
            group.physicalDeviceCount = members;
            if (out != NULL) {
                if (kept >= *count) {
                    result = VK_INCOMPLETE;
                    break;
                }
                group.sType = out[kept].sType;
                group.pNext = out[kept].pNext;
                out[kept] = group;
            }
            kept++;
        }
    }
    free(groups);
    *count = kept;
    return result;
}

/* Every counted heap no larger than the budget; on shared memory (several counted heaps of one memory), their
 * sizes shared out so that together they are no larger than the budget either. */
static void clamp_heaps(const struct physical *physical, VkPhysicalDeviceMemoryProperties *memory)
{
    if (physical == NULL) {
        return;
    }
    int64_t budget = budget_of(physical);
    if (budget <= 0) {
        return;
    }
    uint32_t counted = counted_heaps(physical->type, memory);
    uint64_t sum = 0;
    for (uint32_t heap = 0; heap < memory->memoryHeapCount; heap++) {
        if (counted & (1u << heap)) {
            sum += memory->memoryHeaps[heap].size;
        }
    }
    bool shared = physical->type != VK_PHYSICAL_DEVICE_TYPE_DISCRETE_GPU && sum > (uint64_t)budget;
    for (uint32_t heap = 0; heap < memory->memoryHeapCount; heap++) {
        if (!(counted & (1u << heap))) {
            continue;
        }
        VkDeviceSize size = memory->memoryHeaps[heap].size;
        if (shared) {
            size = (VkDeviceSize)((__uint128_t)size * (uint64_t)budget / sum);
        }
        if (size > (VkDeviceSize)budget) {
            size = (VkDeviceSize)budget;
        }
        memory->memoryHeaps[heap].size = size;
    }
}

static VKAPI_ATTR void VKAPI_CALL layer_GetPhysicalDeviceMemoryProperties(VkPhysicalDevice handle,
                                                                          VkPhysicalDeviceMemoryProperties *out)
{
    struct instance *instance = instance_of(handle);
    instance->GetPhysicalDeviceMemoryProperties(handle, out);
    if (slices_get()->active) {
        clamp_heaps(physical_of(instance, handle), out);
    }
}

static void fill_budget(const struct physical *physical, const VkPhysicalDeviceMemoryProperties *memory,
                        VkPhysicalDeviceMemoryBudgetPropertiesEXT *budget_out, bool emulated)
{
    int64_t budget = budget_of(physical);
    if (emulated) {
        /* The driver left it alone: as a driver that knows nothing more would say. */
        for (uint32_t heap = 0; heap < VK_MAX_MEMORY_HEAPS; heap++) {
            budget_out->heapBudget[heap] = heap < memory->memoryHeapCount ? memory->memoryHeaps[heap].size : 0;
            budget_out->heapUsage[heap] = 0;
        }
    }
    if (budget <= 0) {
        return;
    }
    uint32_t counted = counted_heaps(physical->type, memory);
    int slice = physical->slice->index;
    /* The allocation's figures are on the ledger's page: an application may ask for them before it makes a device
     * (as it sizes itself), when this process has not connected yet. */
    ledger_open();
    /* The ledger's budget where it said one: it is the one held. */
    int64_t held_to = ledger_budget(slice, budget);
    if (held_to > 0 && held_to < budget) {
        budget = held_to;
    }
    /* What this process freed is in the figures before they are read: an application that frees and then asks sees
     * its memory free. */
    ledger_sync(slice);
    /* The shared page is the allocation's processes' to write: whatever it holds (read as >= 0), no arithmetic
     * here overflows. */
    int64_t total = ledger_total(slice);
    /* This process's spare is counted there, yet its own to use: as free as memory no one holds. */
    int64_t spare = ledger_spare(slice, LEDGER_HEAPS);
    total = spare < total ? total - spare : 0;
    int64_t left = total >= budget ? 0 : budget - total;
    for (uint32_t heap = 0; heap < memory->memoryHeapCount; heap++) {
        if (!(counted & (1u << heap))) {
            continue;
        }
        int64_t used = ledger_heap_usage(slice, heap);
        int64_t heap_spare = ledger_spare(slice, heap);
        used = heap_spare < used ? used - heap_spare : 0;
        VkDeviceSize allowed = (VkDeviceSize)used + (VkDeviceSize)left; /* both at most INT64_MAX: no wrap */
        if (allowed > memory->memoryHeaps[heap].size) {
            allowed = memory->memoryHeaps[heap].size;
        }
        if (!emulated && budget_out->heapBudget[heap] < allowed) {
            allowed = budget_out->heapBudget[heap];
        }
        budget_out->heapBudget[heap] = allowed;
        budget_out->heapUsage[heap] = (VkDeviceSize)used;
    }
}

static VKAPI_ATTR void VKAPI_CALL layer_GetPhysicalDeviceMemoryProperties2(VkPhysicalDevice handle,
                                                                           VkPhysicalDeviceMemoryProperties2 *out)
{
    struct instance *instance = instance_of(handle);
    /* Without a slice too: the loader advertises VK_EXT_memory_budget from the manifest, so where the driver lacks
     * it the layer answers as a driver that knows nothing more would (a budget of 0 stops applications). */
    struct physical *physical = physical_of(instance, handle);
    VkPhysicalDeviceMemoryBudgetPropertiesEXT *budget = NULL;
    for (VkBaseOutStructure *next = out->pNext; next != NULL; next = next->pNext) {
        if (next->sType == VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MEMORY_BUDGET_PROPERTIES_EXT) {
            budget = (VkPhysicalDeviceMemoryBudgetPropertiesEXT *)next;
        }
    }
    bool emulated = budget != NULL && (physical == NULL || !physical->native_budget);
    if (emulated) {
        /* The driver does not know the structure: take it out of the chain while it answers. */
        VkBaseOutStructure *previous = (VkBaseOutStructure *)out;
        while (previous->pNext != (VkBaseOutStructure *)budget) {
            previous = previous->pNext;
        }
        previous->pNext = budget->pNext;
        instance->GetPhysicalDeviceMemoryProperties2(handle, out);
        previous->pNext = (VkBaseOutStructure *)budget;
    } else {
        instance->GetPhysicalDeviceMemoryProperties2(handle, out);
    }
    clamp_heaps(physical, &out->memoryProperties);
    if (budget != NULL && physical != NULL) {
        fill_budget(physical, &out->memoryProperties, budget, emulated);
    }
}

static VKAPI_ATTR void VKAPI_CALL layer_GetPhysicalDeviceProperties2(VkPhysicalDevice handle,
                                                                     VkPhysicalDeviceProperties2 *out)
{
    struct instance *instance = instance_of(handle);
    instance->GetPhysicalDeviceProperties2(handle, out);
    if (!slices_get()->active) {
        return;
    }
    int64_t budget = budget_of(physical_of(instance, handle));
    if (budget <= 0) {
        return;
    }
    VkDeviceSize limit = (VkDeviceSize)budget;
    for (VkBaseOutStructure *next = out->pNext; next != NULL; next = next->pNext) {
        switch ((int)next->sType) {
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_3_PROPERTIES: {
            VkPhysicalDeviceMaintenance3Properties *p = (VkPhysicalDeviceMaintenance3Properties *)next;
            if (p->maxMemoryAllocationSize > limit) p->maxMemoryAllocationSize = limit;
            break;
        }
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES: {
            VkPhysicalDeviceVulkan11Properties *p = (VkPhysicalDeviceVulkan11Properties *)next;
            if (p->maxMemoryAllocationSize > limit) p->maxMemoryAllocationSize = limit;
            break;
        }
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_MAINTENANCE_4_PROPERTIES: {
            VkPhysicalDeviceMaintenance4Properties *p = (VkPhysicalDeviceMaintenance4Properties *)next;
            if (p->maxBufferSize > limit) p->maxBufferSize = limit;
            break;
        }
        case VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_PROPERTIES: {
            VkPhysicalDeviceVulkan13Properties *p = (VkPhysicalDeviceVulkan13Properties *)next;
            if (p->maxBufferSize > limit) p->maxBufferSize = limit;
            break;
        }
        default:
            break;
        }
    }
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_EnumerateDeviceExtensionProperties(VkPhysicalDevice handle,
                                                                               const char *layer,
                                                                               uint32_t *count,
                                                                               VkExtensionProperties *out)
{
    static const VkExtensionProperties budget_extension = {VK_EXT_MEMORY_BUDGET_EXTENSION_NAME,
                                                           VK_EXT_MEMORY_BUDGET_SPEC_VERSION};
    if (layer != NULL && strcmp(layer, LAYER_NAME) == 0) {
        /* The layer's own extensions, as its manifest lists them. */
        if (out == NULL) {
            *count = 1;
            return VK_SUCCESS;
        }
        if (*count < 1) {
            return VK_INCOMPLETE;
        }
        out[0] = budget_extension;
        *count = 1;
        return VK_SUCCESS;
    }
    struct instance *instance = instance_of(handle);
    struct physical *physical = physical_of(instance, handle);
    /* Listed once: by the loader where the layer is implicit, by the layer where it is enabled explicitly. */
    bool add = layer == NULL && physical != NULL && !physical->native_budget && !physical->budget_listed;
    if (!add) {
        return instance->EnumerateDeviceExtensionProperties(handle, layer, count, out);
    }
    uint32_t driver = 0;
    VkResult result = instance->EnumerateDeviceExtensionProperties(handle, NULL, &driver, NULL);
    if (result != VK_SUCCESS) {
        return result;
    }
    if (out == NULL) {
        *count = driver + 1;
        return VK_SUCCESS;
    }
    uint32_t room = *count;
    uint32_t written = room < driver ? room : driver;
    result = instance->EnumerateDeviceExtensionProperties(handle, NULL, &written, out);
    if (result < VK_SUCCESS) {
        return result;
    }
    if (written < room) {
        out[written++] = budget_extension;
        *count = written;
        return written < driver + 1 ? VK_INCOMPLETE : VK_SUCCESS;
    }
    *count = written;
    return VK_INCOMPLETE;
}

/* -- the device: creation, and the two calls that move memory --------------------------------------------- */

static VKAPI_ATTR VkResult VKAPI_CALL layer_CreateDevice(VkPhysicalDevice physical_handle,
                                                         const VkDeviceCreateInfo *info,
                                                         const VkAllocationCallbacks *allocator, VkDevice *out)
{
    VkLayerDeviceCreateInfo *link = device_link(info);
    struct instance *instance = instance_of(physical_handle);
    if (link == NULL || instance == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    PFN_vkGetInstanceProcAddr gipa = link->u.pLayerInfo->pfnNextGetInstanceProcAddr;
    PFN_vkGetDeviceProcAddr gdpa = link->u.pLayerInfo->pfnNextGetDeviceProcAddr;
    PFN_vkCreateDevice create = (PFN_vkCreateDevice)gipa(instance->handle, "vkCreateDevice");
    if (create == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    link->u.pLayerInfo = link->u.pLayerInfo->pNext;

    /* The record first: a device the layer could not pass calls down for must not exist. */
    struct device *device = calloc(1, sizeof *device);
    if (device == NULL) {
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    struct physical *physical = physical_of(instance, physical_handle);
    /* VK_EXT_memory_budget where the layer provides it: the driver must not be asked for it. */
    VkDeviceCreateInfo copy = *info;
    const char **names = NULL;
    if (physical != NULL && !physical->native_budget && info->enabledExtensionCount > 0) {
        names = calloc(info->enabledExtensionCount, sizeof *names);
        if (names == NULL) {
            free(device);
            return VK_ERROR_OUT_OF_HOST_MEMORY;
        }
        uint32_t kept = 0;
        for (uint32_t i = 0; i < info->enabledExtensionCount; i++) {
            if (strcmp(info->ppEnabledExtensionNames[i], VK_EXT_MEMORY_BUDGET_EXTENSION_NAME) != 0) {
                names[kept++] = info->ppEnabledExtensionNames[i];
            }
        }
        copy.enabledExtensionCount = kept;
        copy.ppEnabledExtensionNames = names;
    }
    VkResult result = create(physical_handle, &copy, allocator, out);
    free(names);
    if (result != VK_SUCCESS) {
        free(device);
        return result;
    }
    device->key = dispatch_key(*out);
    device->gdpa = gdpa;
    device->DestroyDevice = (PFN_vkDestroyDevice)gdpa(*out, "vkDestroyDevice");
    device->AllocateMemory = (PFN_vkAllocateMemory)gdpa(*out, "vkAllocateMemory");
    device->FreeMemory = (PFN_vkFreeMemory)gdpa(*out, "vkFreeMemory");
    device->QueueSubmit = (PFN_vkQueueSubmit)gdpa(*out, "vkQueueSubmit");
    device->QueueSubmit2 = (PFN_vkQueueSubmit2)gdpa(*out, "vkQueueSubmit2");
    device->QueueSubmit2KHR = (PFN_vkQueueSubmit2KHR)gdpa(*out, "vkQueueSubmit2KHR");
    device->GetMemoryFdKHR = (PFN_vkGetMemoryFdKHR)gdpa(*out, "vkGetMemoryFdKHR");
    struct slice *slice = physical != NULL ? physical->slice : NULL;
    if (slice != NULL && (slice->budget > 0 || slice->compute < 1000)) {
        /* Before the first allocation and submit: the ledger's terms (the compute share among them) are known. */
        ledger_open();
    }
    int compute = slice != NULL ? ledger_compute(slice->index, slice->compute) : 1000;
    if (slice != NULL && compute < 1000) {
        struct duty_calls calls = {
            .QueueSubmit = device->QueueSubmit,
            .CreateFence = (PFN_vkCreateFence)gdpa(*out, "vkCreateFence"),
            .DestroyFence = (PFN_vkDestroyFence)gdpa(*out, "vkDestroyFence"),
            .WaitForFences = (PFN_vkWaitForFences)gdpa(*out, "vkWaitForFences"),
            .ResetFences = (PFN_vkResetFences)gdpa(*out, "vkResetFences"),
        };
        device->duty = duty_create(*out, &calls, ledger_record(slice->index), compute);
    }
    if (physical != NULL && physical->slice != NULL && physical->slice->budget > 0) {
        VkPhysicalDeviceMemoryProperties memory;
        instance->GetPhysicalDeviceMemoryProperties(physical_handle, &memory);
        device->slice = physical->slice;
        device->index = physical->slice->index;
        device->counted_heaps = counted_heaps(physical->type, &memory);
        for (uint32_t type = 0; type < memory.memoryTypeCount; type++) {
            device->type_heap[type] = memory.memoryTypes[type].heapIndex;
        }
    }
    if (!handles_put(&devices, device->key, device)) {
        duty_destroy(device->duty);
        free(device);
        PFN_vkDestroyDevice destroy = (PFN_vkDestroyDevice)gdpa(*out, "vkDestroyDevice");
        destroy(*out, allocator);
        *out = VK_NULL_HANDLE;
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL layer_DestroyDevice(VkDevice handle, const VkAllocationCallbacks *allocator)
{
    if (handle == VK_NULL_HANDLE) {
        return;
    }
    struct device *device = device_of(handle);
    if (device == NULL) {
        return;
    }
    PFN_vkDestroyDevice destroy = device->DestroyDevice;
    handles_drop(&devices, device->key);
    if (device->slice != NULL) {
        untrack_device(device);
    }
    duty_destroy(device->duty);
    free(device);
    destroy(handle, allocator);
}

/* Memory brought in from elsewhere, not made here. An fd (opaque, or a dma-buf) may be an object the ledger knows (an
 * export of the allocation's): *fd says which; other imports are someone else's, and not counted. */
static bool imported(const VkMemoryAllocateInfo *info, int *fd_out)
{
    *fd_out = -1;
    for (const VkBaseInStructure *next = info->pNext; next != NULL; next = next->pNext) {
        switch ((int)next->sType) {
        case VK_STRUCTURE_TYPE_IMPORT_MEMORY_FD_INFO_KHR: {
            /* A handle type of 0 imports nothing. */
            const VkImportMemoryFdInfoKHR *fd = (const VkImportMemoryFdInfoKHR *)next;
            if (fd->handleType != 0) {
                *fd_out = fd->fd;
                return true;
            }
            break;
        }
        case VK_STRUCTURE_TYPE_IMPORT_MEMORY_HOST_POINTER_INFO_EXT: {
            const VkImportMemoryHostPointerInfoEXT *host = (const VkImportMemoryHostPointerInfoEXT *)next;
            if (host->handleType != 0) return true;
            break;
        }
        case VK_STRUCTURE_TYPE_IMPORT_ANDROID_HARDWARE_BUFFER_INFO_ANDROID:
        case VK_STRUCTURE_TYPE_IMPORT_MEMORY_ZIRCON_HANDLE_INFO_FUCHSIA:
        case VK_STRUCTURE_TYPE_IMPORT_METAL_BUFFER_INFO_EXT:
            return true;
        default:
            break;
        }
    }
    return false;
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_AllocateMemory(VkDevice handle, const VkMemoryAllocateInfo *info,
                                                           const VkAllocationCallbacks *allocator,
                                                           VkDeviceMemory *out)
{
    struct device *device = device_of(handle);
    if (device == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    if (device->slice == NULL || info == NULL || info->memoryTypeIndex >= VK_MAX_MEMORY_TYPES) {
        return device->AllocateMemory(handle, info, allocator, out);
    }
    uint32_t heap = device->type_heap[info->memoryTypeIndex];
    int fd = -1;
    bool in = imported(info, &fd);
    if (!(device->counted_heaps & (1u << heap)) || (in && fd < 0)) {
        return device->AllocateMemory(handle, info, allocator, out);
    }
    int64_t size = info->allocationSize > (VkDeviceSize)INT64_MAX ? INT64_MAX : (int64_t)info->allocationSize;
    if (in) {
        /* Known by its file, taken before the driver owns (and may close) the fd. */
        struct ledger_key key;
        if (!ledger_key_of(fd, &key)) {
            return device->AllocateMemory(handle, info, allocator, out);
        }
        VkResult result = device->AllocateMemory(handle, info, allocator, out);
        /* The allocation's own export is held by this process too until it frees this handle; anything else is
         * someone else's memory. */
        if (result == VK_SUCCESS && ledger_hold(device->index, heap, size, key) &&
            !track(device, (uint64_t)(uintptr_t)*out, size, heap, &key)) {
            /* Without a record the free could not let go of it: undo, as an import that failed. */
            device->FreeMemory(handle, *out, allocator);
            ledger_unhold(key);
            *out = VK_NULL_HANDLE;
            return VK_ERROR_OUT_OF_HOST_MEMORY;
        }
        return result;
    }
    /* Reserve first, so that threads and processes racing for the last bytes cannot both have them. */
    if (!ledger_reserve(device->index, heap, size)) {
        return VK_ERROR_OUT_OF_DEVICE_MEMORY;
    }
    VkResult result = device->AllocateMemory(handle, info, allocator, out);
    if (result != VK_SUCCESS) {
        ledger_release(device->index, heap, size);
        return result;
    }
    if (!track(device, (uint64_t)(uintptr_t)*out, size, heap, NULL)) {
        /* Without a record the free could not give it back: undo, as an allocation that failed. */
        device->FreeMemory(handle, *out, allocator);
        ledger_release(device->index, heap, size);
        *out = VK_NULL_HANDLE;
        return VK_ERROR_OUT_OF_HOST_MEMORY;
    }
    return VK_SUCCESS;
}

static VKAPI_ATTR void VKAPI_CALL layer_FreeMemory(VkDevice handle, VkDeviceMemory memory,
                                                   const VkAllocationCallbacks *allocator)
{
    struct device *device = device_of(handle);
    if (device == NULL) {
        return;
    }
    /* Forgotten before the driver frees it: once freed, the handle can come back from a concurrent allocation, whose
     * record must stay. */
    struct allocation *entry = device->slice != NULL && memory != VK_NULL_HANDLE
                                   ? untrack(device, (uint64_t)(uintptr_t)memory) : NULL;
    device->FreeMemory(handle, memory, allocator);
    if (entry != NULL) {
        /* Exported or imported memory lets go of its object (whoever else holds it keeps it charged); an
         * ancestor's stays the ancestor's. */
        give_back(device, entry);
        free(entry);
    }
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_GetMemoryFdKHR(VkDevice handle, const VkMemoryGetFdInfoKHR *info,
                                                           int *fd)
{
    struct device *device = device_of(handle);
    if (device == NULL || device->GetMemoryFdKHR == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    VkResult result = device->GetMemoryFdKHR(handle, info, fd);
    struct ledger_key key;
    if (result == VK_SUCCESS && device->slice != NULL && info != NULL && fd != NULL && ledger_key_of(*fd, &key)) {
        mark_exported(device, (uint64_t)(uintptr_t)info->memory, key);
    }
    return result;
}

/* -- submits: held to the slice's share of GPU time, where it has one ------------------------------------- */

static VKAPI_ATTR VkResult VKAPI_CALL layer_QueueSubmit(VkQueue queue, uint32_t count, const VkSubmitInfo *submits,
                                                        VkFence fence)
{
    struct device *device = device_of(queue);
    if (device == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    if (device->duty == NULL || count == 0) {
        return device->QueueSubmit(queue, count, submits, fence);
    }
    int64_t released = duty_wait(device->duty);
    int64_t submitted = duty_now();
    VkResult result = device->QueueSubmit(queue, count, submits, fence);
    if (result == VK_SUCCESS) {
        duty_track(device->duty, queue, submitted, released);
    }
    return result;
}

static VkResult submit2(VkQueue queue, uint32_t count, const VkSubmitInfo2 *submits, VkFence fence, bool khr)
{
    struct device *device = device_of(queue);
    if (device == NULL) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    PFN_vkQueueSubmit2 next = khr ? device->QueueSubmit2KHR : device->QueueSubmit2;
    if (next == NULL) {
        return VK_ERROR_FEATURE_NOT_PRESENT;
    }
    if (device->duty == NULL || count == 0) {
        return next(queue, count, submits, fence);
    }
    int64_t released = duty_wait(device->duty);
    int64_t submitted = duty_now();
    VkResult result = next(queue, count, submits, fence);
    if (result == VK_SUCCESS) {
        duty_track(device->duty, queue, submitted, released);
    }
    return result;
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_QueueSubmit2(VkQueue queue, uint32_t count,
                                                         const VkSubmitInfo2 *submits, VkFence fence)
{
    return submit2(queue, count, submits, fence, false);
}

static VKAPI_ATTR VkResult VKAPI_CALL layer_QueueSubmit2KHR(VkQueue queue, uint32_t count,
                                                            const VkSubmitInfo2 *submits, VkFence fence)
{
    return submit2(queue, count, submits, fence, true);
}

/* -- the entry points ------------------------------------------------------------------------------------- */

static PFN_vkVoidFunction device_function(const char *name)
{
#define HOOK(fn) if (strcmp(name, "vk" #fn) == 0) return (PFN_vkVoidFunction)layer_##fn
    HOOK(DestroyDevice);
    HOOK(AllocateMemory);
    HOOK(FreeMemory);
#undef HOOK
    return NULL;
}

/* Only a device whose memory is counted has its exports go through the layer. */
static PFN_vkVoidFunction slice_function(const char *name)
{
    return strcmp(name, "vkGetMemoryFdKHR") == 0 ? (PFN_vkVoidFunction)layer_GetMemoryFdKHR : NULL;
}

/* Only a device held to a compute share has its submits go through the layer; any other's go straight down. */
static PFN_vkVoidFunction submit_function(const char *name)
{
#define HOOK(fn) if (strcmp(name, "vk" #fn) == 0) return (PFN_vkVoidFunction)layer_##fn
    HOOK(QueueSubmit);
    HOOK(QueueSubmit2);
    HOOK(QueueSubmit2KHR);
#undef HOOK
    return NULL;
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL layer_GetDeviceProcAddr(VkDevice handle, const char *name);

static PFN_vkVoidFunction instance_function(const char *name)
{
#define HOOK(fn) if (strcmp(name, "vk" #fn) == 0) return (PFN_vkVoidFunction)layer_##fn
#define ALIAS(alias, fn) if (strcmp(name, alias) == 0) return (PFN_vkVoidFunction)layer_##fn
    HOOK(CreateInstance);
    HOOK(DestroyInstance);
    HOOK(EnumeratePhysicalDevices);
    HOOK(EnumeratePhysicalDeviceGroups);
    ALIAS("vkEnumeratePhysicalDeviceGroupsKHR", EnumeratePhysicalDeviceGroups);
    HOOK(GetPhysicalDeviceMemoryProperties);
    HOOK(GetPhysicalDeviceMemoryProperties2);
    ALIAS("vkGetPhysicalDeviceMemoryProperties2KHR", GetPhysicalDeviceMemoryProperties2);
    HOOK(GetPhysicalDeviceProperties2);
    ALIAS("vkGetPhysicalDeviceProperties2KHR", GetPhysicalDeviceProperties2);
    HOOK(EnumerateDeviceExtensionProperties);
    HOOK(CreateDevice);
    HOOK(GetDeviceProcAddr);
#undef ALIAS
#undef HOOK
    return NULL;
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL layer_GetDeviceProcAddr(VkDevice handle, const char *name)
{
    PFN_vkVoidFunction own = device_function(name);
    if (own != NULL) {
        return own;
    }
    struct device *device = device_of(handle);
    if (device == NULL) {
        return NULL;
    }
    PFN_vkVoidFunction next = device->gdpa(handle, name);
    /* A function the layers below do not have (vkQueueSubmit2 on a device without it) is not offered either. */
    own = device->duty != NULL && next != NULL ? submit_function(name) : NULL;
    if (own == NULL && device->slice != NULL && next != NULL) {
        own = slice_function(name);
    }
    return own != NULL ? own : next;
}

static VKAPI_ATTR PFN_vkVoidFunction VKAPI_CALL layer_GetInstanceProcAddr(VkInstance handle, const char *name)
{
    if (strcmp(name, "vkGetInstanceProcAddr") == 0) {
        return (PFN_vkVoidFunction)layer_GetInstanceProcAddr;
    }
    PFN_vkVoidFunction own = instance_function(name);
    if (own == NULL) {
        own = device_function(name);
    }
    if (handle == VK_NULL_HANDLE) {
        return strcmp(name, "vkCreateInstance") == 0 ? own : NULL;
    }
    struct instance *instance = instance_of(handle);
    if (instance == NULL) {
        return own;
    }
    PFN_vkVoidFunction next = instance->gipa(handle, name);
    /* A function the layers below do not have is not one the layer may offer either (a 1.0 instance's
     * vkGetPhysicalDeviceProperties2, say); vkCreateDevice and the device's own always exist. */
    if (own != NULL && (next != NULL || strcmp(name, "vkGetDeviceProcAddr") == 0)) {
        return own;
    }
    return next;
}

EXPORT VKAPI_ATTR VkResult VKAPI_CALL vkNegotiateLoaderLayerInterfaceVersion(VkNegotiateLayerInterface *version)
{
    if (version == NULL || version->sType != LAYER_NEGOTIATE_INTERFACE_STRUCT) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    if (version->loaderLayerInterfaceVersion < 2) {
        return VK_ERROR_INITIALIZATION_FAILED;
    }
    version->loaderLayerInterfaceVersion = 2;
    version->pfnGetInstanceProcAddr = layer_GetInstanceProcAddr;
    version->pfnGetDeviceProcAddr = layer_GetDeviceProcAddr;
    version->pfnGetPhysicalDeviceProcAddr = NULL;
    return VK_SUCCESS;
}
